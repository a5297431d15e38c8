"""An artifact from the store is used only if it fits the model and prefix: `from_bytes`
accepts only the format, `validate` only what the drafter can index. Every malformed shape
is refused with ArtifactFormatError naming the field; every built artifact passes."""

from __future__ import annotations

import inspect
import json
import textwrap
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save

from decoder.compressors.artifact import (
    FORMAT,
    ArtifactFormatError,
    from_bytes,
    to_bytes,
    validate,
)
from decoder.compressors.base import CompressedKV, CompressedLayer, DenseLayer
from decoder.compressors.registry import parse_compressor
from decoder.engine import prefill_prefix
from decoder.store_source import kv_layout

DENSE = "snapkv:budget=0.25"
QUANTIZED = "kivi:bits=4,residual=32"


@pytest.fixture(scope="module")
def prefix(builtin_model, builtin_runner):
    tokens = builtin_model.encode(inspect.getsource(textwrap))[:300]
    return prefill_prefix(builtin_runner, tokens, observe=128)


@pytest.fixture(scope="module")
def built(prefix, builtin_model):
    """Bytes of the artifact of each spec, as the store would hold them."""
    c = builtin_model.config
    out = {}
    for spec in (DENSE, QUANTIZED, "streamingllm:budget=64", "pyramidkv:budget=0.25+kivi:bits=2"):
        pipeline = parse_compressor(spec)
        compressed = pipeline.compress(
            prefix.source, prefix.observed, c.num_layers, c.num_kv_heads, c.head_dim
        )
        out[spec] = (pipeline.spec, to_bytes(compressed))
    return out


def fresh(built, spec) -> CompressedKV:
    """A private copy of a built artifact (through bytes, as a fetch makes one)."""
    return from_bytes(built[spec][1])


def check(compressed, model, prefix, spec=None) -> None:
    """Validate what a fetch of `compressed` from the store would give."""
    validate(from_bytes(to_bytes(compressed)), model.config, prefix.source.length, spec)


def test_every_built_artifact_fits(built, builtin_model, prefix):
    for canonical, data in built.values():
        back = from_bytes(data)
        validate(back, builtin_model.config, prefix.source.length, canonical)
        # A store layout of the model describes the same KV.
        layout = kv_layout(builtin_model.config, builtin_model.fingerprint)
        validate(back, layout, prefix.source.length, canonical)


def _dense(compressed: CompressedKV, index: int, **change) -> CompressedKV:
    layer = compressed.layers[index]
    fields = {"k": layer.k, "v": layer.v, "positions": layer.positions, **change}
    compressed.layers[index] = DenseLayer(**fields)
    return compressed


DENSE_CASES = {
    "zero layers": (lambda a: replace(a, layers=[]), r"0 layers, want the model's \d+"),
    "one layer too few": (lambda a: replace(a, layers=a.layers[:-1]), r"layers, want"),
    "wrong head_dim": (
        lambda a: _dense(a, 3, k=a.layers[3].k[..., :-1], v=a.layers[3].v[..., :-1]),
        r"layer 3: k: shape \[\d+, \d+, \d+\], want",
    ),
    "wrong kv heads": (
        lambda a: _dense(
            a, 0, k=a.layers[0].k[:-1], v=a.layers[0].v[:-1], positions=a.layers[0].positions[:-1]
        ),
        r"layer 0: positions: shape",
    ),
    "wrong dtype": (lambda a: _dense(a, 1, v=a.layers[1].v.half()), r"layer 1: v: dtype"),
    "k and v of different lengths": (
        lambda a: _dense(a, 2, v=a.layers[2].v[:, :-1]),
        r"layer 2: v: shape",
    ),
    "wrong prefix length": (
        lambda a: replace(a, prefix_length=a.prefix_length + 1),
        r"prefix_length \d+, want the prefix's \d+ tokens",
    ),
    "positions past the prefix": (
        lambda a: _dense(a, 0, positions=a.layers[0].positions + a.prefix_length),
        r"layer 0: positions: must increase per head within",
    ),
    "positions not increasing": (
        lambda a: _dense(a, 0, positions=a.layers[0].positions.flip(1)),
        r"layer 0: positions: must increase",
    ),
    "another spec": (lambda a: replace(a, spec="h2o:budget=0.5"), r"spec 'h2o:budget=0.5'"),
    "a byte count that is not a number": (
        lambda a: replace(a, full_nbytes="lots"),
        r"full_nbytes 'lots'",
    ),
}


@pytest.mark.parametrize("case", DENSE_CASES)
def test_malformed_dense_artifacts_are_refused(case, built, builtin_model, prefix):
    mutate, message = DENSE_CASES[case]
    bad = mutate(fresh(built, DENSE))
    with pytest.raises(ArtifactFormatError, match=message):
        check(bad, builtin_model, prefix, built[DENSE][0])


def _set(compressed: CompressedKV, index: int, **fields) -> CompressedKV:
    for name, value in fields.items():
        setattr(compressed.layers[index], name, value)
    return compressed


QUANTIZED_CASES = {
    "unknown bit width": (lambda a: _set(a, 0, bits=3), r"layer 0: bits 3, want one of"),
    "wrong head_dim in the shape": (
        lambda a: _set(a, 1, shape=(a.layers[1].shape[0], a.layers[1].shape[1], 7)),
        r"layer 1: shape \(\d+, \d+, 7\), want",
    ),
    "truncated key codes": (
        lambda a: _set(a, 2, k_codes=a.layers[2].k_codes[..., :-1]),
        r"layer 2: k_codes: shape",
    ),
    "scales in float32": (
        lambda a: _set(a, 0, v_scale=a.layers[0].v_scale.float()),
        r"layer 0: v_scale: dtype torch.float32, want torch.float16",
    ),
    "a residual of the wrong width": (
        lambda a: _set(a, 4, residual_v=a.layers[4].residual_v[..., :-2]),
        r"layer 4: residual_v: shape",
    ),
    "fewer positions than quantized tokens": (
        lambda a: _set(a, 0, positions=a.layers[0].positions[:, :8]),
        r"layer 0: \d+ quantized tokens but only 8 positions",
    ),
    "a group that does not divide the tokens": (
        lambda a: _set(a, 0, k_codes=torch.zeros(a.layers[0].shape[0], 1, 7, 1, dtype=torch.uint8)),
        r"layer 0: group of 7 does not divide",
    ),
}


@pytest.mark.parametrize("case", QUANTIZED_CASES)
def test_malformed_quantized_artifacts_are_refused(case, built, builtin_model, prefix):
    mutate, message = QUANTIZED_CASES[case]
    bad = mutate(fresh(built, QUANTIZED))
    with pytest.raises(ArtifactFormatError, match=message):
        check(bad, builtin_model, prefix)


def test_a_layer_type_the_format_does_not_know_is_refused(built, builtin_model, prefix):
    class Foreign(CompressedLayer):
        nbytes = quantized = 0

        def materialize(self):
            raise AssertionError("never used")

    bad = fresh(built, DENSE)
    bad.layers[5] = Foreign()
    with pytest.raises(ArtifactFormatError, match="layer 5: unknown type Foreign"):
        validate(bad, builtin_model.config, prefix.source.length)


def _raw(header: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    return save(tensors, metadata={"format": FORMAT, "header": json.dumps(header)})


def test_bytes_outside_the_format_are_refused_before_use():
    k = torch.zeros(3, 4, 8)
    pos = torch.zeros(3, 4, dtype=torch.int32)
    dense = {"0.k": k, "0.v": k.clone(), "0.positions": pos}
    head = {"spec": "snapkv", "prefix_length": 4, "full_nbytes": 0}
    layer = {"type": "DenseLayer", "scalars": {}}
    cases = [
        ({"layers": [layer]}, dense, "header: missing spec, prefix_length, full_nbytes"),
        ({**head, "layers": "all of them"}, {}, "a list of layers"),
        ({**head, "layers": [7]}, {}, "layer 0: want an object"),
        ({**head, "layers": [{**layer, "type": ["x"]}]}, dense, "layer 0: unknown type"),
        (  # a scalar that would shadow a method of the layer
            {**head, "layers": [{**layer, "scalars": {"materialize": 1}}]},
            dense,
            r"layer 0: scalars \['materialize'\], want \[\]",
        ),
        (
            {**head, "layers": [layer]},
            {"0.k": k, "0.v": k.clone()},
            "layer 0: tensor positions is missing",
        ),
        (
            {**head, "layers": [layer]},
            {**dense, "1.k": k.clone()},
            "tensors 1.k belong to no layer",
        ),
    ]
    for header, tensors, message in cases:
        with pytest.raises(ArtifactFormatError, match=message):
            from_bytes(_raw(header, tensors))
    back = from_bytes(_raw({**head, "layers": [layer]}, dense))  # the well-formed one reads
    assert isinstance(back.layers[0], DenseLayer) and back.layers[0].kept == 4
