"""Compressed KV as bytes: what the prefix store keeps as a prefix's compressed artifact.

A `CompressedKV` is written with safetensors (tensors by name, no pickle) plus a JSON header
in the safetensors metadata naming each layer's class and its scalar fields. Reading it back
gives the same tensors bit for bit, so drafting from a fetched artifact is drafting from the
one that was built.

Bytes from the store are untrusted (any writer of the prefix may have put them there), so
reading and using are two checks: `from_bytes` accepts only this format (known layer types
with exactly their declared fields), and `validate` accepts only an artifact that fits the
model and the prefix it is used for, in every shape the drafter indexes. An artifact that
passed both cannot fail a draft step; one that fails either raises `ArtifactFormatError`
(DATA_LOSS) naming what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from safetensors.torch import load, save

from decoder.compressors.base import CompressedKV, CompressedLayer, DenseLayer
from decoder.compressors.kivi import QuantizedLayer
from decoder.errors import ArtifactFormatError

FORMAT = "vericache-compressed-kv-v1"
QUANTIZED_BITS = (2, 4, 8)


class KVShape(Protocol):
    """The model's KV layout an artifact must match (a `ModelConfig` or a store `KVLayout`)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


# -- writing and reading ---------------------------------------------------------------------


def to_bytes(compressed: CompressedKV) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for index, layer in enumerate(compressed.layers):
        name = type(layer).__name__
        if name not in _FORMATS:
            raise ArtifactFormatError(f"layer {index}: cannot serialise a {name}")
        scalars = {}
        for field, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{field}"] = value.contiguous()
            else:
                scalars[field] = value
        layers.append({"type": name, "scalars": scalars})
    header = {
        "spec": compressed.spec,
        "prefix_length": compressed.prefix_length,
        "full_nbytes": compressed.full_nbytes,
        "layers": layers,
    }
    return save(tensors, metadata={"format": FORMAT, "header": json.dumps(header)})


def from_bytes(data: bytes) -> CompressedKV:
    """The artifact in `data`, read as this format only (whether it fits a model is
    `validate`'s question). Any bytes that are not one (truncated, without their header,
    garbage, hostile) raise ArtifactFormatError, never another error."""
    try:
        return _read(data)
    except ArtifactFormatError:
        raise
    except Exception as error:  # noqa: BLE001 - untrusted bytes: any failure is theirs
        raise ArtifactFormatError(
            f"not a compressed-KV artifact: {type(error).__name__}: {error}"
        ) from error


def _read(data: bytes) -> CompressedKV:
    """`from_bytes`, raising whatever the bytes make the reading raise."""
    tensors = load(bytes(data))
    metadata = _metadata(data)
    if metadata.get("format") != FORMAT:
        raise ArtifactFormatError(f"artifact format {metadata.get('format')!r}, want {FORMAT}")
    header = _header(metadata)
    layers = [_layer(index, entry, tensors) for index, entry in enumerate(header["layers"])]
    claimed = {f"{i}.{f}" for i, layer in enumerate(layers) for f in vars(layer)}
    stray = sorted(set(tensors) - claimed)
    if stray:
        raise ArtifactFormatError(f"tensors {', '.join(stray[:3])} belong to no layer")
    return CompressedKV(header["spec"], header["prefix_length"], layers, header["full_nbytes"])


def _header(metadata: dict[str, str]) -> dict[str, Any]:
    try:
        header = json.loads(metadata["header"])
    except (KeyError, TypeError, ValueError) as error:
        raise ArtifactFormatError(f"header: not readable ({error!r})") from error
    if not isinstance(header, dict) or not isinstance(header.get("layers"), list):
        raise ArtifactFormatError("header: want an object with a list of layers")
    missing = [key for key in ("spec", "prefix_length", "full_nbytes") if key not in header]
    if missing:
        raise ArtifactFormatError(f"header: missing {', '.join(missing)}")
    return header


def _layer(index: int, entry: Any, tensors: dict[str, torch.Tensor]) -> CompressedLayer:
    """A layer with exactly the fields its type declares (no other attribute is set)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("scalars"), dict):
        raise ArtifactFormatError(f"layer {index}: want an object with type and scalars")
    name = entry.get("type")
    fmt = _FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ArtifactFormatError(f"layer {index}: unknown type {entry.get('type')!r}")
    scalars = entry["scalars"]
    if set(scalars) != set(fmt.scalars):
        raise ArtifactFormatError(
            f"layer {index}: scalars {sorted(scalars)}, want {sorted(fmt.scalars)}"
        )
    layer = fmt.cls.__new__(fmt.cls)
    for field, value in scalars.items():
        setattr(layer, field, tuple(value) if isinstance(value, list) else value)
    for field in fmt.tensors:
        if f"{index}.{field}" not in tensors:
            raise ArtifactFormatError(f"layer {index}: tensor {field} is missing")
        setattr(layer, field, tensors[f"{index}.{field}"])
    return layer


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__` (an 8-byte length, then JSON)."""
    size = int.from_bytes(bytes(data[:8]), "little")
    metadata = json.loads(bytes(data[8 : 8 + size])).get("__metadata__", {})
    return metadata if isinstance(metadata, dict) else {}


# -- fitting a model and a prefix ------------------------------------------------------------


def validate(
    compressed: CompressedKV, model: KVShape, prefix_length: int, spec: str | None = None
) -> None:
    """Check that `compressed` is the compressed KV of a `prefix_length`-token prefix of a
    model with this KV layout (and of `spec`, when given), in the dtypes and shapes the
    drafter indexes: one layer per model layer, each of a known type whose tensors are
    [KVH, kept, D] (or that type's packed equivalent) with positions increasing per head
    within the prefix. Raises ArtifactFormatError naming the first thing that is wrong."""
    _check_header(compressed, model, prefix_length, spec)
    for index, layer in enumerate(compressed.layers):
        fmt = next((f for f in _FORMATS.values() if isinstance(layer, f.cls)), None)
        if fmt is None:
            raise ArtifactFormatError(f"layer {index}: unknown type {type(layer).__name__}")
        try:
            fmt.check(layer, model, prefix_length)
        except ArtifactFormatError as error:
            raise ArtifactFormatError(f"layer {index}: {error}") from None


def _check_header(
    compressed: CompressedKV, model: KVShape, prefix_length: int, spec: str | None
) -> None:
    c = compressed
    if not isinstance(c.spec, str) or (spec is not None and c.spec != spec):
        raise ArtifactFormatError(f"spec {c.spec!r}, want {spec!r}")
    if not _is_int(c.prefix_length) or c.prefix_length != prefix_length:
        raise ArtifactFormatError(
            f"prefix_length {c.prefix_length!r}, want the prefix's {prefix_length} tokens"
        )
    if not _is_int(c.full_nbytes) or c.full_nbytes < 0:
        raise ArtifactFormatError(f"full_nbytes {c.full_nbytes!r}, want a byte count >= 0")
    layers = len(c.layers) if isinstance(c.layers, list) else None
    if layers != model.num_layers:
        raise ArtifactFormatError(f"{layers} layers, want the model's {model.num_layers}")


def _check_dense(layer: CompressedLayer, model: KVShape, prefix_length: int) -> None:
    kept = _check_positions(layer, model, prefix_length)
    for field in ("k", "v"):
        _tensor(layer, field, torch.float32, (model.num_kv_heads, kept, model.head_dim))


def _check_quantized(layer: CompressedLayer, model: KVShape, prefix_length: int) -> None:
    """KIVI's packing (see `decoder.compressors.kivi`): n quantized tokens in groups of G
    (keys per channel, values per token), then a full-precision residual."""
    bits, n, group = _quantized_geometry(layer, model)
    kv, dim, per = model.num_kv_heads, model.head_dim, 8 // bits
    residual = _check_positions(layer, model, prefix_length) - n
    if residual < 0:
        raise ArtifactFormatError(f"{n} quantized tokens but only {n + residual} positions")
    expected = {
        "k_codes": (torch.uint8, (kv, n // group, group, dim // per)),
        "k_scale": (torch.float16, (kv, n // group, 1, dim)),
        "k_zero": (torch.float16, (kv, n // group, 1, dim)),
        "v_codes": (torch.uint8, (kv, n, dim // group, group // per)),
        "v_scale": (torch.float16, (kv, n, dim // group, 1)),
        "v_zero": (torch.float16, (kv, n, dim // group, 1)),
        "residual_k": (torch.float32, (kv, residual, dim)),
        "residual_v": (torch.float32, (kv, residual, dim)),
    }
    for field, (dtype, shape) in expected.items():
        _tensor(layer, field, dtype, shape)


def _quantized_geometry(layer: CompressedLayer, model: KVShape) -> tuple[int, int, int]:
    """(bits, quantized tokens n, group G) of a quantized layer, checked against the model."""
    bits, shape = getattr(layer, "bits", None), getattr(layer, "shape", None)
    if not _is_int(bits) or bits not in QUANTIZED_BITS:
        raise ArtifactFormatError(f"bits {bits!r}, want one of {QUANTIZED_BITS}")
    kv, dim = model.num_kv_heads, model.head_dim
    ints = isinstance(shape, tuple) and len(shape) == 3 and all(map(_is_int, shape))
    if not ints or shape[0] != kv or shape[2] != dim:
        raise ArtifactFormatError(f"shape {shape!r}, want ({kv}, tokens, {dim})")
    codes = _tensor(layer, "k_codes", torch.uint8, None)
    group, n, per = (codes.shape[2] if codes.dim() == 4 else 0), shape[1], 8 // bits
    if group < 1 or n < 0 or n % group or dim % group or dim % per or group % per:
        raise ArtifactFormatError(
            f"group of {group} does not divide {n} tokens and {dim} channels in {bits}-bit codes"
        )
    return bits, n, group


def _check_positions(layer: CompressedLayer, model: KVShape, prefix_length: int) -> int:
    """positions: int32 [KVH, kept], increasing per head within [0, prefix_length); kept."""
    positions = _tensor(layer, "positions", torch.int32, None)
    if positions.dim() != 2 or positions.shape[0] != model.num_kv_heads:
        raise ArtifactFormatError(
            f"positions: shape {list(positions.shape)}, want [{model.num_kv_heads}, kept]"
        )
    if positions.numel() and (
        int(positions.min()) < 0
        or int(positions.max()) >= prefix_length
        or bool((positions.diff(dim=1) <= 0).any())
    ):
        raise ArtifactFormatError(f"positions: must increase per head within [0, {prefix_length})")
    return positions.shape[1]


def _tensor(
    layer: CompressedLayer, field: str, dtype: torch.dtype, shape: tuple[int, ...] | None
) -> torch.Tensor:
    tensor = getattr(layer, field, None)
    if not isinstance(tensor, torch.Tensor):
        raise ArtifactFormatError(f"{field}: missing")
    if tensor.dtype != dtype:
        raise ArtifactFormatError(f"{field}: dtype {tensor.dtype}, want {dtype}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise ArtifactFormatError(f"{field}: shape {list(tensor.shape)}, want {list(shape)}")
    return tensor


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class _Format:
    """One layer type of the format: the fields it travels with and how it must fit."""

    cls: type[CompressedLayer]
    tensors: tuple[str, ...]
    scalars: tuple[str, ...]
    check: Callable[[CompressedLayer, KVShape, int], None]


_FORMATS: dict[str, _Format] = {
    f.cls.__name__: f
    for f in (
        _Format(DenseLayer, ("k", "v", "positions"), (), _check_dense),
        _Format(
            QuantizedLayer,
            ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
            + ("residual_k", "residual_v", "positions"),
            ("bits", "shape"),
            _check_quantized,
        ),
    )
}
