"""Compressed-KV artifacts (`decoder.compressors.artifact`): safetensors with a JSON header.
Bytes from the store are untrusted; the clear error is ArtifactFormatError (DATA_LOSS) from
`from_bytes` (not this format) or `validate` (does not fit the model and prefix), never
another exception and never a declared size allocated. A built artifact round-trips bit
for bit and validates."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load, save

from decoder.compressors.artifact import ArtifactFormatError, from_bytes, to_bytes, validate
from decoder.compressors.base import CompressedKV, DenseLayer
from decoder.compressors.kivi import QuantizedLayer
from tests.fuzz.mutate import memory_cap, mutated

MODEL = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
PREFIX = 12


@st.composite
def positions(draw, kept: int) -> torch.Tensor:
    """int32 [KVH, kept]: increasing per head within the prefix."""
    rows = [
        sorted(draw(st.sets(st.integers(0, PREFIX - 1), min_size=kept, max_size=kept)))
        for _ in range(MODEL.num_kv_heads)
    ]
    return torch.tensor(rows, dtype=torch.int32).reshape(MODEL.num_kv_heads, kept)


def values(kept: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(MODEL.num_kv_heads, kept, MODEL.head_dim, generator=g)


@st.composite
def layers(draw):
    seed = draw(st.integers(0, 2**16))
    if draw(st.booleans()):
        kept = draw(st.integers(0, PREFIX))
        return DenseLayer(values(kept, seed), values(kept, seed + 1), draw(positions(kept)))
    group, bits = 4, draw(st.sampled_from((2, 4, 8)))
    n = group * draw(st.integers(0, 2))
    residual = draw(st.integers(0, PREFIX - n))
    return QuantizedLayer(
        values(n, seed),
        values(n, seed + 1),
        values(residual, seed + 2),
        values(residual, seed + 3),
        draw(positions(n + residual)),
        bits,
        group,
    )


ARTIFACTS = st.builds(
    lambda layers, nbytes: CompressedKV("fuzz:spec", PREFIX, layers, nbytes),
    st.lists(layers(), min_size=MODEL.num_layers, max_size=MODEL.num_layers),
    st.integers(0, 2**40),
)


def fields(layer) -> dict:
    return {name: value for name, value in vars(layer).items()}


@given(ARTIFACTS)
def test_artifacts_round_trip(compressed):
    back = from_bytes(to_bytes(compressed))
    validate(back, MODEL, PREFIX, "fuzz:spec")
    assert (back.spec, back.prefix_length, back.full_nbytes) == (
        "fuzz:spec",
        PREFIX,
        back.full_nbytes,
    )
    for ours, theirs in zip(compressed.layers, back.layers, strict=True):
        assert type(ours) is type(theirs)
        for name, value in fields(ours).items():
            other = getattr(theirs, name)
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(value, other)
            else:
                assert value == other


def read_and_check(data: bytes) -> None:
    """Refused with ArtifactFormatError or accepted whole; nothing else."""
    try:
        with memory_cap():
            validate(from_bytes(data), MODEL, PREFIX)
    except ArtifactFormatError:
        pass


@given(mutated(ARTIFACTS.map(to_bytes), max_edits=3))
def test_artifact_byte_mutations(data):
    read_and_check(data)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
PLACES = st.sampled_from(
    ["spec", "prefix_length", "full_nbytes", "layers", "layer", "type", "scalars", "scalar"]
)


@given(ARTIFACTS, st.lists(st.tuples(PLACES, JSON), min_size=1, max_size=3), st.data())
def test_artifact_header_mutations(compressed, edits, data):
    """Wrong types and values in the JSON header (the tensors left as they were)."""
    raw = to_bytes(compressed)
    tensors = load(raw)
    header = json.loads(
        json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]["header"]
    )
    for place, value in edits:
        layers = header["layers"] if isinstance(header["layers"], list) else []
        index = data.draw(st.integers(0, MODEL.num_layers - 1))
        layer = layers[index] if index < len(layers) else None
        if place == "layer" and layer is not None:
            layers[index] = value
        elif place in ("type", "scalars") and isinstance(layer, dict):
            layer[place] = value
        elif (
            place == "scalar" and isinstance(layer, dict) and isinstance(layer.get("scalars"), dict)
        ):
            scalars = layer["scalars"]
            scalars[data.draw(st.sampled_from(sorted(scalars) or ["bits"]))] = value
        elif place in ("spec", "prefix_length", "full_nbytes", "layers"):
            header[place] = value
    metadata = {"format": "vericache-compressed-kv-v1", "header": json.dumps(header)}
    read_and_check(save(tensors, metadata=metadata))


TENSOR_EDITS = st.sampled_from(["dtype", "shape", "drop", "extra", "positions"])


@given(ARTIFACTS, st.lists(TENSOR_EDITS, min_size=1, max_size=3), st.data())
def test_artifact_tensor_mutations(compressed, edits, data):
    """Tensors of the wrong dtype or shape, missing, stray, or positions out of order."""
    raw = to_bytes(compressed)
    tensors = dict(load(raw))
    metadata = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    for edit in edits:
        if not tensors:
            break
        name = data.draw(st.sampled_from(sorted(tensors)))
        tensor = tensors[name]
        if edit == "dtype":
            tensors[name] = tensor.to(
                data.draw(st.sampled_from([torch.float16, torch.int64, torch.uint8]))
            )
        elif edit == "shape":
            tensors[name] = torch.zeros(tensor.numel() + 1, dtype=tensor.dtype)
        elif edit == "drop":
            del tensors[name]
        elif edit == "extra":
            tensors["9.k"] = torch.zeros(1)
        elif name.endswith("positions") and tensor.numel():
            tensors[name] = tensor.flip(-1).contiguous()
    read_and_check(save(tensors, metadata=metadata))
