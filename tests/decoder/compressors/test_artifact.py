"""Compressed KV survives the trip to bytes and back bit for bit (what the store keeps)."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from decoder.compressors.artifact import ArtifactFormatError, from_bytes, to_bytes
from decoder.compressors.registry import parse_compressor
from decoder.engine import prefill_prefix


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
