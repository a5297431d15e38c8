"""Compressed KV survives the trip to bytes and back bit for bit (what the store keeps)."""

from __future__ import annotations

import inspect
import textwrap

import grpc
import pytest
import torch
from safetensors.torch import save

from decoder.compressors.artifact import FORMAT, ArtifactFormatError, from_bytes, to_bytes
from decoder.compressors.registry import parse_compressor
from decoder.engine import prefill_prefix
from decoder.service.status import code_of


@pytest.fixture(scope="module")
def prefix(builtin_model, builtin_runner):
    tokens = builtin_model.encode(inspect.getsource(textwrap))[:300]
    return prefill_prefix(builtin_runner, tokens, observe=128)


@pytest.mark.parametrize(
    "spec",
    [
        "snapkv:budget=0.25",
        "streamingllm:budget=64",
        "kivi:bits=4,residual=32",
        "pyramidkv:budget=0.25+kivi:bits=2,residual=32",
    ],
)
def test_round_trip_is_bitwise(spec, prefix, builtin_model):
    c = builtin_model.config
    built = parse_compressor(spec).compress(
        prefix.source, prefix.observed, c.num_layers, c.num_kv_heads, c.head_dim
    )
    data = to_bytes(built)
    back = from_bytes(data)
    assert (back.spec, back.prefix_length, back.full_nbytes) == (
        built.spec,
        built.prefix_length,
        built.full_nbytes,
    )
    assert back.nbytes == built.nbytes and len(data) >= built.nbytes
    for a, b in zip(built.layers, back.layers, strict=True):
        assert type(a) is type(b) and torch.equal(a.positions, b.positions)
        for x, y in zip(a.materialize(), b.materialize(), strict=True):
            assert torch.equal(x, y)


def test_bytes_that_are_not_an_artifact_are_refused():
    with pytest.raises(ArtifactFormatError):
        from_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(ArtifactFormatError):
        from_bytes(b"not safetensors at all")


def test_every_malformed_artifact_is_a_format_error(prefix, builtin_model):
    """Truncated at every length, without its header, garbage or hostile: always
    ArtifactFormatError (DATA_LOSS), never another error (which would be INTERNAL)."""
    c = builtin_model.config
    good = to_bytes(
        parse_compressor("streamingllm:budget=8").compress(
            prefix.source, prefix.observed, c.num_layers, c.num_kv_heads, c.head_dim
        )
    )
    k = torch.zeros(2, 3, 4)
    cases = [good[:n] for n in range(0, len(good), max(1, len(good) // 4096))]
    cases += [
        save({"0.k": k}),  # a safetensors file without metadata
        save({"0.k": k}, metadata={"format": FORMAT}),  # without the header
        save({}, metadata={"format": FORMAT, "header": "{"}),
        save({}, metadata={"format": FORMAT, "header": "[" * 100_000}),  # nested too deep
        save({}, metadata={"format": FORMAT, "header": "null"}),
        (1 << 62).to_bytes(8, "little") + b"{}",
        b"\xff" * 64,
        b"",
    ]
    for data in cases:
        with pytest.raises(ArtifactFormatError):
            from_bytes(data)
    assert code_of(ArtifactFormatError("x")) == grpc.StatusCode.DATA_LOSS
