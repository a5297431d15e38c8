"""Low-precision copies of linear weights, for the drafter (fast mode) only.

A draft step computes a whole forward for a handful of rows, so it is bound by reading the
weights. The drafter may use a cheaper copy of them: its tokens are proposals that the exact
fp32 verifier checks, so precision only moves the acceptance rate, never the output.
Exact mode never uses anything here (DESIGN.md sections 5 and 10).

- "fp16": weights rounded to fp16, activations and arithmetic fp32 (fbgemm). The default:
  on the development machines (AMD EPYC, 2 cores, a whole draft forward bound by reading
  the weights from memory) it was 2.8x the fp32 forward at 1 row, 2.1x at 4, and its
  greedy drafts matched the fp32 drafter's at every position tried.
- "int8": per-output-channel symmetric int8 weights; activations quantized per call, per
  tensor (torch's dynamic quantized linear, fbgemm). 3.0x at 1 row, 2.5x at 4, but the
  activations' outlier channels cost precision: about 8% of its greedy drafts differed.
- "bf16": bf16 weights, activations cast to bf16 per call (oneDNN's packed kernel where
  the platform allows it, else `F.linear`). Slower than fp32 there beyond one row: oneDNN
  is capped at AVX2 for exact mode (decoder/__init__.py), where it has no bf16 kernel.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F

REDUCE_RANGE = True
"""Quantize activations to 7 bits, as torch's dynamic quantized linear does on x86: 8-bit
activations can saturate the 16-bit intermediate sums of AVX2 kernels without VNNI."""

_INT8_ENGINES = ("fbgemm", "x86")  # quantized engines whose linear_prepack packs for fbgemm


class LinearFn(Protocol):
    """What the runner calls a linear layer: x [N, in] fp32 -> [N, out] fp32."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def int8_engine() -> str | None:
    """The quantized engine used to pack int8 weights, or None where none is available."""
    supported = torch.backends.quantized.supported_engines
    return next((e for e in _INT8_ENGINES if e in supported), None)


class Int8Linear:
    """y ~= x @ W^T with W in int8, one scale per output channel; x quantized per call.

    Relative error against fp32 was about 1-2% of the output's largest magnitude on the
    model's shapes. Raises RuntimeError at construction where no int8 engine is available
    (see `int8_engine`).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        engine = int8_engine()
        if engine is None:
            raise RuntimeError(
                "int8 draft weights need torch's fbgemm quantized engine, not available "
                f"here (engines: {torch.backends.quantized.supported_engines}); "
                "use RunnerConfig(draft_weights='fp32')"
            )
        out_features, in_features = weight.shape
        scales = (weight.abs().amax(dim=1).double() / 127.0).clamp_min(1e-12)
        zero_points = torch.zeros(out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated; still the API
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        with _quantized_engine(engine):
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        # fbgemm keeps the int8 weight (for unpacking) besides its packed copy, and per
        # channel: a float64 scale, an int64 zero point and an int32 column offset.
        self.nbytes = 2 * out_features * in_features + out_features * (8 + 8 + 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] fp32 -> [N, out] fp32."""
        return torch.ops.quantized.linear_dynamic(x, self._packed, REDUCE_RANGE)


class Fp16Linear:
    """y ~= x @ W^T with W rounded to fp16 (fbgemm); x stays fp32, as does the arithmetic.

    Only the weights are rounded (relative error about 2e-4 on the model's shapes), so its
    drafts matched the fp32 drafter's. Raises RuntimeError at construction where the fbgemm
    engine is not available (see `int8_engine`).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        engine = int8_engine()
        if engine is None:
            raise RuntimeError(
                "fp16 draft weights need torch's fbgemm quantized engine, not available "
                f"here (engines: {torch.backends.quantized.supported_engines}); "
                "use RunnerConfig(draft_weights='fp32')"
            )
        with _quantized_engine(engine):
            self._packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
        self.nbytes = 2 * weight.numel()  # fbgemm keeps only its packed fp16 matrix

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] fp32 -> [N, out] fp32."""
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)


class Bf16Linear:
    """y ~= x @ W^T with W and x rounded to bf16; accumulates in fp32, returns fp32."""

    def __init__(self, weight: torch.Tensor) -> None:
        bf16 = weight.to(torch.bfloat16).contiguous()
        self.packed = True
        try:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(bf16, None)
        except (RuntimeError, AttributeError):  # no bf16 oneDNN kernel under the ISA cap
            self.packed = False
            self.weight = bf16
        self.nbytes = self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] fp32 -> [N, out] fp32."""
        xb = x.to(torch.bfloat16)
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(xb, self.weight, None, "none", [], "")
        else:
            y = F.linear(xb, self.weight)
        return y.float()


def low_precision_linear(weight: torch.Tensor, kind: str) -> Int8Linear | Fp16Linear | Bf16Linear:
    """A low-precision copy of `weight` ([out, in] fp32) of `kind` "int8", "fp16" or "bf16".

    Raises ValueError for any other kind, RuntimeError where the fbgemm engine that int8
    and fp16 need is unavailable.
    """
    kinds = {"int8": Int8Linear, "fp16": Fp16Linear, "bf16": Bf16Linear}
    if kind not in kinds:
        raise ValueError(f"low-precision linear kind must be one of {tuple(kinds)}, got {kind!r}")
    return kinds[kind](weight)


@contextlib.contextmanager
def _quantized_engine(engine: str) -> Iterator[None]:
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous
