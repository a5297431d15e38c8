"""Start-up proof that exact mode is exact on this platform.

Exact mode leans on properties of the platform's kernels (see `numerics.cpu.forward`) that no
API promises. Before the first exact forward, the runner pushes the same tokens through
the model's own shapes grouped in several ways: one prefill, a chunk that crosses a key
chunk boundary, single-token steps, a batch beside another sequence, and two requests over
one shared prefix buffer together and alone. Every token's logits and KV must agree bit for
bit; otherwise exact mode is refused.

The check runs on the model's first two layers (same kernels and shapes, a fraction of the
time). Its result is cached per process, and on disk (`<cache>/selfcheck/`, one small JSON
file per key) so that a second process does not pay for it: the key covers the platform
(machine, CPU model and capability), the torch version, the thread count, the model's
shapes and runner settings, the first two layers' weights, the attention kernel's id and
the source of the code the check runs (this module, the runner, its kernels and views).
Any change to one of them runs the check again; deleting the folder does too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from decoder.config import ModelConfig, RunnerConfig
from decoder.seq_input import SeqInput
from decoder.views import SharedPrefixView
from decoder.weights import ModelWeights
from numerics.cpu.forward import exact_kernel_id
from numerics.cpu.fused import cache_dir as kernel_cache_dir

log = logging.getLogger(__name__)
_RESULTS: dict[tuple, str | None] = {}
CHECKED_LAYERS = 2
SOURCES = (
    "decoder/selfcheck.py",
    "decoder/runner.py",
    "decoder/seq_input.py",
    "numerics/cpu/forward.py",
    "decoder/views.py",
    "decoder/kv_cache.py",
)
"""The modules whose code the check exercises (from the repository root): a change to one
runs it again."""


def check_exact_mode(
    runner_type: Callable, config: ModelConfig, weights: ModelWeights, rc: RunnerConfig
) -> str | None:
    """None when exact mode holds here, else a one-line description of the first violation.
    `runner_type(config, weights, rc)` builds the runner checked (`ModelRunner` itself: the
    runner calls this before its first exact forward)."""
    key = (
        config,
        replace(rc, self_check=False),
        torch.get_num_threads(),
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        exact_kernel_id(config.head_dim),
    )
    if key not in _RESULTS:
        path = _cache_path(key, weights)
        cached = _read(path)
        if cached is not None:
            _RESULTS[key] = cached["problem"]
        else:
            _RESULTS[key] = _run_check(runner_type, config, weights, rc)
            _write(path, {"problem": _RESULTS[key], "key": repr(key)})
    return _RESULTS[key]


def _cache_path(key: tuple, weights: ModelWeights) -> Path:
    digest = hashlib.sha256(repr(key).encode())
    digest.update(f"{platform.machine()}|{_cpu_model()}".encode())
    root = Path(__file__).parent.parent
    for name in SOURCES:
        digest.update((root / name).read_bytes())
    for layer in weights.layers[:CHECKED_LAYERS]:
        for tensor in layer.tensors():
            digest.update(tensor.detach().contiguous().numpy().tobytes())
    return kernel_cache_dir() / "selfcheck" / f"{digest.hexdigest()[:32]}.json"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    problem = data.get("problem") if isinstance(data, dict) else 0
    return data if problem is None or isinstance(problem, str) else None


def _write(path: Path, data: dict) -> None:
    """Atomically (a reader never sees half a file); a cache that cannot be written is
    only a slower next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".selfcheck-")
        with os.fdopen(fd, "w") as file:
            json.dump(data, file)
        os.replace(tmp, path)
    except OSError as error:
        log.info("exact-mode self-check result not cached: %s", error)


def _run_check(
    runner_type: Callable, config: ModelConfig, weights: ModelWeights, rc: RunnerConfig
) -> str | None:
    layers = min(2, config.num_layers)
    runner = runner_type(
        replace(config, num_layers=layers), weights.truncated(layers), replace(rc, self_check=False)
    )
    g = torch.Generator().manual_seed(20260517)
    total = rc.key_chunk + 44
    tokens = torch.randint(0, config.vocab_size, (total,), generator=g)
    other = torch.randint(0, config.vocab_size, (37,), generator=g)

    whole = runner.new_cache()
    reference = runner.forward([SeqInput.extend(whole, tokens, "all")])[0]

    pieces = runner.new_cache()
    a = rc.key_chunk - 6  # the 9-token chunk below crosses the key-chunk boundary
    got = [
        runner.forward([SeqInput.extend(pieces, tokens[s:e], "all")])[0]
        for s, e in [(0, a), (a, a + 9), (a + 9, a + 10), (a + 10, a + 11)]
    ]
    beside = runner.new_cache()
    batched = runner.forward(
        [SeqInput.extend(beside, other, "all"), SeqInput.extend(pieces, tokens[a + 11 :], "all")]
    )
    got.append(batched[1])
    alone = runner.forward([SeqInput.extend(runner.new_cache(), other, "all")])[0]

    grouped = torch.cat(got)
    if not torch.equal(grouped, reference):
        return _describe(
            grouped,
            reference,
            f"logits of a {total}-token prefill and of the "
            "same tokens fed in chunks, single steps and a batch",
        )
    if not torch.equal(alone, batched[0]):
        return _describe(batched[0], alone, "logits of a sequence alone and beside another")
    for index, (x, y) in enumerate(zip(pieces.layers, whole.layers, strict=True)):
        for name in ("k", "v"):
            a_kv, b_kv = getattr(x, name)[:, :total], getattr(y, name)[:, :total]
            if not torch.equal(a_kv, b_kv):
                return _describe(
                    a_kv.transpose(0, 1),
                    b_kv.transpose(0, 1),
                    f"layer {index} {name.upper()} of a prefill and of chunks",
                )
    return _check_shared_prefix(runner, whole, rc.key_chunk + 10, other)


def _check_shared_prefix(runner, cache, prefix_length: int, tokens: torch.Tensor) -> str | None:
    """Two requests over one prefix buffer in one forward (shared-prefix attention) give
    the logits each gives alone. The prefix is the first `prefix_length` tokens of `cache`
    (one full key chunk and part of the next)."""
    buffer = cache.clone(extra_capacity=64)
    buffer.truncate(prefix_length)
    pieces = [tokens[:5], tokens[5:8]]

    def views(prefix_id: object | None) -> list[SharedPrefixView]:
        return [
            SharedPrefixView(
                lambda i: buffer.layers[i], prefix_length, runner.new_cache(), prefix_id
            )
            for _ in pieces
        ]

    together = runner.forward(
        [SeqInput.extend(v, x, "all") for v, x in zip(views(object()), pieces, strict=True)]
    )
    for i, (view, x) in enumerate(zip(views(None), pieces, strict=True)):
        alone = runner.forward([SeqInput.extend(view, x, "all")])[0]
        if not torch.equal(together[i], alone):
            return _describe(
                together[i],
                alone,
                f"logits of request {i} over a shared prefix, alone and together",
            )
    return None


def _describe(got: torch.Tensor, want: torch.Tensor, what: str) -> str:
    differs = (got != want).flatten(1).any(-1)
    first = int(differs.nonzero()[0]) if differs.any() else -1
    diff = float((got - want).abs().max())
    return f"{what} differ (first at token {first}, max abs diff {diff:.3g})"
