"""Compressor specs: the registry of methods and the one parser of spec strings.

A spec is one or more stages joined by `+`, each `name` or `name:key=value,...`, for
example `snapkv:budget=0.125,window=32` or `snapkv:budget=0.25+kivi:bits=4`. At most one
token-dropping stage and one quantizing stage, dropping first. Budgets are a fraction of
the prefix (0 < f < 1, written with a decimal point) or a token count (an integer).
"""

from __future__ import annotations

import torch

from decoder.compressors.base import (
    Budget,
    CompressedKV,
    Compressor,
    DenseLayer,
    LayerContext,
)
from decoder.compressors.h2o import H2O
from decoder.compressors.kivi import KIVI
from decoder.compressors.pyramidkv import PyramidKV
from decoder.compressors.snapkv import SnapKV
from decoder.compressors.streamingllm import StreamingLLM
from decoder.errors import CompressorSpecError

REGISTRY: dict[str, type[Compressor]] = {
    cls.name: cls for cls in (StreamingLLM, SnapKV, H2O, PyramidKV, KIVI)
}

_MINIMUM = {"window": 1, "kernel": 1, "group": 1, "beta": 1}


class CompressorPipeline:
    """The parsed stages of a spec, applied layer by layer to a prefix's full KV."""

    def __init__(self, stages: list[Compressor]) -> None:
        self.stages = stages

    @property
    def spec(self) -> str:
        return "+".join(stage.spec for stage in self.stages)

    @property
    def observe_window(self) -> int:
        return max(stage.observe_window for stage in self.stages)

    def observes_enough(self, observed: list[torch.Tensor] | None, prefix_length: int) -> bool:
        """Whether `observed` (per layer [w, H, D]) holds the queries this spec scores with:
        the last `observe_window` of the prefix (all of a shorter prefix)."""
        if not self.observe_window:
            return True
        need = min(prefix_length, self.observe_window)
        return observed is not None and observed[0].shape[0] >= need

    def compress(
        self,
        source,
        observed: list[torch.Tensor] | None,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
    ) -> CompressedKV:
        """source: a FullKVSource; observed: per layer [w, H, D] queries ending the prefix."""
        n = source.length
        if not self.observes_enough(observed, n):
            raise ValueError(
                f"{self.spec} needs the prefill's last {self.observe_window} queries per layer"
            )
        positions = torch.arange(n, dtype=torch.int32).expand(kv_heads, -1)
        layers = []
        for index in range(num_layers):
            k, v = torch.empty(kv_heads, n, head_dim), torch.empty(kv_heads, n, head_dim)
            source.read_layer(index, k, v)
            layer = DenseLayer(k, v, positions)
            ctx = LayerContext(index, num_layers, n)
            for stage in self.stages:
                layer = stage.compress_layer(layer, observed[index] if observed else None, ctx)
            layers.append(layer)
        return CompressedKV(self.spec, n, layers, source.nbytes)


def parse_compressor(spec: str) -> CompressorPipeline:
    """Parse a spec string; CompressorSpecError names what is wrong and what is allowed."""
    text = spec.strip()
    if not text:
        raise CompressorSpecError(f"empty compressor spec; {_allowed_names()}")
    stages = [_parse_stage(part.strip()) for part in text.split("+")]
    droppers = [s for s in stages if s.drops_tokens]
    quantizers = [s for s in stages if not s.drops_tokens]
    if (
        len(droppers) > 1
        or len(quantizers) > 1
        or (droppers and quantizers and stages.index(droppers[0]) > stages.index(quantizers[0]))
    ):
        drop = ", ".join(n for n, c in REGISTRY.items() if c.drops_tokens)
        quantize = ", ".join(n for n, c in REGISTRY.items() if not c.drops_tokens)
        raise CompressorSpecError(
            f"compressor spec {spec!r}: compose at most one token-dropping method ({drop}) "
            f"followed by at most one quantizer ({quantize})"
        )
    return CompressorPipeline(stages)


def describe_compressors() -> str:
    """One line per method with its parameters and defaults (for --help and errors)."""
    lines = []
    for name, cls in REGISTRY.items():
        params = ", ".join(f"{k}={v.default} ({v.help})" for k, v in cls.params.items())
        lines.append(f"{name}: {params}")
    return "\n".join(lines)


def _parse_stage(text: str) -> Compressor:
    name, _, args = text.partition(":")
    cls = REGISTRY.get(name.strip().lower())
    if cls is None:
        raise CompressorSpecError(f"unknown compressor {name.strip()!r}; {_allowed_names()}")
    values = {key: p.default for key, p in cls.params.items()}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, raw = (s.strip() for s in item.partition("="))
        if key not in cls.params:
            raise CompressorSpecError(
                f"{cls.name}: unknown parameter {key!r}; allowed: {', '.join(cls.params)}"
            )
        if not eq or not raw:
            raise CompressorSpecError(f"{cls.name}: parameter {key!r} needs a value ({key}=...)")
        values[key] = _parse_value(cls.name, key, cls.params[key].kind, raw)
    stage = cls(**values)
    if getattr(stage, "kernel", 1) % 2 == 0:
        raise CompressorSpecError(f"{cls.name}: kernel must be odd, got {stage.kernel}")
    return stage


def _parse_value(method: str, key: str, kind: str, raw: str):
    where = f"{method}: {key}={raw!r}"
    if kind == "budget":
        return _parse_budget(where, raw)
    if kind.startswith("choice:"):
        choices = kind.removeprefix("choice:").split("|")
        if raw not in choices:
            raise CompressorSpecError(f"{where}: must be one of {', '.join(choices)}")
        return int(raw)
    try:
        value = int(raw) if kind == "int" else float(raw)
    except ValueError:
        expected = "an integer" if kind == "int" else "a number"
        raise CompressorSpecError(f"{where}: expected {expected}") from None
    if kind == "int" and value < _MINIMUM.get(key, 0):
        raise CompressorSpecError(f"{where}: must be >= {_MINIMUM.get(key, 0)}")
    if kind == "float" and not 0.0 <= value <= 1.0:
        raise CompressorSpecError(f"{where}: must be between 0 and 1")
    return value


def _parse_budget(where: str, raw: str) -> Budget:
    if raw.isdigit():
        if int(raw) < 1:
            raise CompressorSpecError(f"{where}: a token budget must be >= 1")
        return Budget(tokens=int(raw))
    try:
        fraction = float(raw)
    except ValueError:
        raise CompressorSpecError(
            f"{where}: a budget is a fraction in (0, 1) such as 0.125 or a token count such as 1024"
        ) from None
    if not 0.0 < fraction < 1.0:
        raise CompressorSpecError(
            f"{where}: a fractional budget must be in (0, 1); write a token count as an integer"
        )
    return Budget(fraction=fraction)


def _allowed_names() -> str:
    return (
        f"allowed: {', '.join(REGISTRY)} (compose with '+', e.g. 'snapkv:budget=0.25+kivi:bits=4')"
    )
