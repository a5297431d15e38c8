"""KIVI (Liu et al., 2024): asymmetric 2/4/8-bit KV quantization.

Keys are quantized per channel over groups of `group` consecutive tokens, values per token
over groups of `group` channels; the most recent `residual` tokens (rounded up to a whole
group) stay in full precision. Codes are bit-packed into uint8 and scales/zero points are
fp16, so the bytes saved are the bytes actually kept in memory.
"""

from __future__ import annotations

import torch

from decoder.compressors.base import (
    CompressedLayer,
    Compressor,
    LayerContext,
    Param,
    _nbytes,
)


class KIVI(Compressor):
    name = "kivi"
    drops_tokens = False
    params = {
        "bits": Param("choice:2|4|8", 2, "bits per quantized value"),
        "residual": Param("int", 128, "most recent tokens kept in full precision"),
        "group": Param("int", 32, "tokens per key group and channels per value group"),
    }

    def compress_layer(
        self, layer: CompressedLayer, queries: torch.Tensor | None, ctx: LayerContext
    ) -> CompressedLayer:
        if layer.quantized:
            raise ValueError("kivi cannot quantize an already quantized layer")
        k, v = layer.materialize()
        n, dim = k.shape[1], k.shape[2]
        quantized = max(0, (n - self.residual) // self.group * self.group)
        if quantized == 0 or dim % self.group:
            return layer
        return QuantizedLayer(
            k[:, :quantized],
            v[:, :quantized],
            k[:, quantized:].clone(),
            v[:, quantized:].clone(),
            layer.positions,
            self.bits,
            self.group,
        )


class QuantizedLayer(CompressedLayer):
    """Packed keys (per channel) and values (per token) plus a full-precision residual."""

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        residual_k: torch.Tensor,
        residual_v: torch.Tensor,
        positions: torch.Tensor,
        bits: int,
        group: int,
    ) -> None:
        heads, n, dim = k.shape
        self.bits, self.shape = bits, (heads, n, dim)
        # keys: [KVH, n/G, G, D], min/max over the G tokens of each channel
        self.k_codes, self.k_scale, self.k_zero = _quantize(
            k.view(heads, n // group, group, dim), 2, bits
        )
        # values: [KVH, n, D/G, G], min/max over the G channels of each token
        self.v_codes, self.v_scale, self.v_zero = _quantize(
            v.view(heads, n, dim // group, group), 3, bits
        )
        self.residual_k, self.residual_v = residual_k, residual_v
        self.positions = positions.to(torch.int32)

    @property
    def nbytes(self) -> int:
        return _nbytes(
            self.k_codes,
            self.k_scale,
            self.k_zero,
            self.v_codes,
            self.v_scale,
            self.v_zero,
            self.residual_k,
            self.residual_v,
            self.positions,
        )

    @property
    def quantized(self) -> bool:
        return True

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        heads, n, dim = self.shape
        k = _dequantize(self.k_codes, self.k_scale, self.k_zero, self.bits).view(heads, n, dim)
        v = _dequantize(self.v_codes, self.v_scale, self.v_zero, self.bits).view(heads, n, dim)
        return torch.cat([k, self.residual_k], dim=1), torch.cat([v, self.residual_v], dim=1)


def _quantize(x: torch.Tensor, dim: int, bits: int):
    """Asymmetric min/max quantization along `dim`; codes packed along the last axis."""
    levels = (1 << bits) - 1
    zero = x.amin(dim, keepdim=True).half()
    scale = ((x.amax(dim, keepdim=True) - zero.float()) / levels).half()
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = torch.round((x - zero.float()) / safe).clamp_(0, levels).to(torch.uint8)
    return _pack(codes, bits), scale, zero


def _dequantize(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
) -> torch.Tensor:
    return _unpack(packed, bits).float() * scale.float() + zero.float()


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return codes
    grouped = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, dtype=torch.uint8) * bits
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(per, dtype=torch.uint8) * bits
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.view(*packed.shape[:-1], packed.shape[-1] * per)
