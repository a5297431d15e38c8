"""Compressed KV as bytes: what the prefix store keeps as a prefix's compressed artifact.

A `CompressedKV` is written with safetensors (tensors by name, no pickle) plus a JSON header
in the safetensors metadata naming each layer's class and its scalar fields. Reading it back
gives the same tensors bit for bit, so drafting from a fetched artifact is drafting from the
one that was built.
"""

from __future__ import annotations

import json

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from decoder.compressors.base import CompressedKV, CompressedLayer, DenseLayer
from decoder.compressors.kivi import QuantizedLayer

FORMAT = "vericache-compressed-kv-v1"
LAYER_TYPES: dict[str, type[CompressedLayer]] = {
    "DenseLayer": DenseLayer,
    "QuantizedLayer": QuantizedLayer,
}


class ArtifactFormatError(ValueError):
    """Bytes that are not a compressed-KV artifact of this format."""


def to_bytes(compressed: CompressedKV) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for index, layer in enumerate(compressed.layers):
        name = type(layer).__name__
        if name not in LAYER_TYPES:
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
    try:
        tensors = load(bytes(data))
        metadata = _metadata(data)
    except (SafetensorError, ValueError, KeyError, OSError) as error:
        raise ArtifactFormatError(f"not a compressed-KV artifact: {error}") from error
    if metadata.get("format") != FORMAT:
        raise ArtifactFormatError(f"artifact format {metadata.get('format')!r}, want {FORMAT}")
    header = json.loads(metadata["header"])
    layers = [_layer(index, entry, tensors) for index, entry in enumerate(header["layers"])]
    return CompressedKV(header["spec"], header["prefix_length"], layers, header["full_nbytes"])


def _layer(index: int, entry: dict, tensors: dict[str, torch.Tensor]) -> CompressedLayer:
    cls = LAYER_TYPES.get(entry["type"])
    if cls is None:
        raise ArtifactFormatError(f"layer {index}: unknown type {entry['type']!r}")
    layer = cls.__new__(cls)
    for field, value in entry["scalars"].items():
        setattr(layer, field, tuple(value) if isinstance(value, list) else value)
    prefix = f"{index}."
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            setattr(layer, name[len(prefix) :], tensor)
    return layer


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__` (an 8-byte length, then JSON)."""
    size = int.from_bytes(bytes(data[:8]), "little")
    return json.loads(bytes(data[8 : 8 + size])).get("__metadata__", {})
