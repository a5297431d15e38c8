"""Compressor spec strings: one parser, canonical forms, errors that list what is allowed."""

from __future__ import annotations

import pytest

from decoder.compressors import REGISTRY, parse_compressor
from decoder.errors import CompressorSpecError


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("snapkv", "snapkv:budget=0.125,window=32,kernel=7"),
        ("snapkv:budget=0.25,window=16", "snapkv:budget=0.25,window=16,kernel=7"),
        ("streamingllm:sink=4,window=512", "streamingllm:sink=4,window=512,budget=0.125"),
        ("h2o:budget=1024", "h2o:budget=1024,recent=0.5,window=128"),
        ("pyramidkv:budget=0.125", "pyramidkv:budget=0.125,window=32,kernel=7,beta=20"),
        ("kivi:bits=4,residual=64", "kivi:bits=4,residual=64,group=32"),
        (
            " SnapKV:budget=0.25 + kivi:bits=4 ",
            "snapkv:budget=0.25,window=32,kernel=7+kivi:bits=4,residual=128,group=32",
        ),
    ],
)
def test_specs_parse_to_canonical_form(spec, canonical):
    assert parse_compressor(spec).spec == canonical
    assert parse_compressor(canonical).spec == canonical


def test_budget_is_a_fraction_or_a_token_count():
    fraction = parse_compressor("snapkv:budget=0.125").stages[0].budget
    count = parse_compressor("snapkv:budget=300").stages[0].budget
    assert fraction.resolve(2000) == 250 and fraction.resolve(4) == 1
    assert count.resolve(2000) == 300 and count.resolve(100) == 100


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty compressor spec; allowed: streamingllm, snapkv, h2o, pyramidkv, kivi"),
        ("zip:level=9", "unknown compressor 'zip'; allowed: streamingllm, snapkv, h2o"),
        ("snapkv:size=3", "snapkv: unknown parameter 'size'; allowed: budget, window, kernel"),
        ("snapkv:budget", "snapkv: parameter 'budget' needs a value"),
        ("snapkv:budget=1.5", "a fractional budget must be in (0, 1)"),
        ("snapkv:budget=0", "a token budget must be >= 1"),
        ("snapkv:budget=0.0", "a fractional budget must be in (0, 1)"),
        ("snapkv:budget=lots", "a budget is a fraction in (0, 1) such as 0.125 or a token count"),
        ("snapkv:window=0", "snapkv: window='0': must be >= 1"),
        ("snapkv:kernel=4", "snapkv: kernel must be odd"),
        ("kivi:bits=3", "kivi: bits='3': must be one of 2, 4, 8"),
        ("h2o:recent=2", "h2o: recent='2': must be between 0 and 1"),
        ("kivi:bits=4+snapkv", "compose at most one token-dropping method"),
        ("snapkv+h2o", "compose at most one token-dropping method"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(CompressorSpecError) as err:
        parse_compressor(spec)
    assert message in str(err.value)


def test_registry_has_every_required_method():
    assert {"streamingllm", "snapkv", "h2o", "pyramidkv", "kivi"} <= set(REGISTRY)
