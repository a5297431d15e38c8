"""Each compressor keeps what its method says, with original positions and real byte sizes."""

from __future__ import annotations

import pytest
import torch

from decoder.compressors import parse_compressor
from decoder.compressors.kivi import _pack, _unpack
from decoder.config import ModelConfig
from decoder.kv_cache import KVCache
from decoder.kv_source import LocalKVSource

LAYERS, HEADS, KV_HEADS, DIM, N = 4, 6, 2, 64, 1000
CONFIG = ModelConfig(
    vocab_size=16,
    hidden_size=8,
    intermediate_size=8,
    num_layers=LAYERS,
    num_heads=HEADS,
    num_kv_heads=KV_HEADS,
    head_dim=DIM,
)
FULL_BYTES = LAYERS * 2 * KV_HEADS * N * DIM * 4


@pytest.fixture(scope="module")
def prefix():
    g = torch.Generator().manual_seed(0)
    cache = KVCache(CONFIG, granule=256, capacity=N)
    for layer in cache.layers:
        layer.append(
            torch.randn(KV_HEADS, N, DIM, generator=g),
            torch.randn(KV_HEADS, N, DIM, generator=g),
            torch.arange(N),
        )
    observed = [torch.randn(128, HEADS, DIM, generator=g) for _ in range(LAYERS)]
    return LocalKVSource(cache), observed, cache


def compress(spec, prefix):
    source, observed, _ = prefix
    pipeline = parse_compressor(spec)
    return pipeline.compress(source, observed, LAYERS, KV_HEADS, DIM)


def assert_original_kv(layer, cache_layer):
    """Kept rows are the full KV rows at their own positions (token dropping is lossless per
    kept token)."""
    k, v = layer.materialize()
    pos = layer.positions.long()
    for h in range(KV_HEADS):
        assert torch.equal(k[h], cache_layer.k[h, pos[h]])
        assert torch.equal(v[h], cache_layer.v[h, pos[h]])


def test_streamingllm_keeps_sinks_and_recent_window(prefix):
    out = compress("streamingllm:sink=4,window=96", prefix)
    want = torch.cat([torch.arange(4), torch.arange(N - 96, N)]).int()
    for layer, cache_layer in zip(out.layers, prefix[2].layers, strict=True):
        assert torch.equal(layer.positions, want.expand(KV_HEADS, -1))
        assert_original_kv(layer, cache_layer)
    assert out.full_nbytes == FULL_BYTES
    assert out.nbytes == LAYERS * (2 * KV_HEADS * 100 * DIM * 4 + KV_HEADS * 100 * 4)


@pytest.mark.parametrize("spec", ["snapkv:budget=0.125", "h2o:budget=125"])
def test_score_based_droppers_keep_the_budget_per_head_with_the_window(spec, prefix):
    out = compress(spec, prefix)
    for layer, cache_layer in zip(out.layers, prefix[2].layers, strict=True):
        assert layer.positions.shape == (KV_HEADS, 125)
        assert bool((layer.positions.diff(dim=1) > 0).all()), "increasing positions per head"
        assert int(layer.positions[:, -1].min()) == N - 1, "the most recent token is kept"
        assert_original_kv(layer, cache_layer)
    heads_differ = any(
        not torch.equal(layer.positions[0], layer.positions[1]) for layer in out.layers
    )
    assert heads_differ, "each kv head picks its own tokens"
    assert out.ratio > 7.5


def test_snapkv_keeps_the_keys_the_window_attends_to(prefix):
    source, observed, cache = prefix
    loud = cache.clone()
    # Make position 123 of every layer a key that the observed queries all attend to.
    for layer, q in zip(loud.layers, observed, strict=True):
        direction = q[-32:].mean(0).view(KV_HEADS, HEADS // KV_HEADS, DIM).mean(1)
        layer.k[:, 123] = 50 * direction / direction.norm(dim=-1, keepdim=True)
    out = parse_compressor("snapkv:budget=64").compress(
        LocalKVSource(loud), observed, LAYERS, KV_HEADS, DIM
    )
    for layer in out.layers:
        assert bool((layer.positions == 123).any(dim=1).all())


def test_pyramidkv_budgets_shrink_up_the_layers_around_the_mean(prefix):
    out = compress("pyramidkv:budget=0.125", prefix)
    kept = [layer.kept for layer in out.layers]
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]
    assert abs(sum(kept) / LAYERS - 125) <= 2
    assert min(kept) >= 32


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_stores_packed_codes_and_fp16_scales(bits, prefix):
    out = compress(f"kivi:bits={bits},residual=128", prefix)
    quantized = (N - 128) // 32 * 32  # 864 tokens, the rest stays fp32
    residual = N - quantized
    per_layer = KV_HEADS * (
        2 * quantized * DIM * bits // 8  # key and value codes
        + 2 * 2 * (quantized // 32) * DIM  # key scale + zero per 32-token group and channel
        + 2 * 2 * quantized * (DIM // 32)  # value scale + zero per token and 32-channel group
        + 2 * residual * DIM * 4  # fp32 residual keys and values
        + N * 4
    )  # int32 positions
    assert out.nbytes == LAYERS * per_layer
    for layer, cache_layer in zip(out.layers, prefix[2].layers, strict=True):
        k, v = layer.materialize()
        assert k.shape == (KV_HEADS, N, DIM)
        assert torch.equal(k[:, quantized:], cache_layer.k[:, quantized:N])
        err = (k[:, :quantized] - cache_layer.k[:, :quantized]).abs().max()
        spread = cache_layer.k[:, :N].max() - cache_layer.k[:, :N].min()
        assert err <= spread / (2**bits - 1), "within one quantization step"


def test_composition_drops_then_quantizes(prefix):
    dropped = compress("snapkv:budget=0.25", prefix)
    both = compress("snapkv:budget=0.25+kivi:bits=4,residual=32", prefix)
    for a, b in zip(dropped.layers, both.layers, strict=True):
        assert torch.equal(a.positions, b.positions)
        assert b.quantized and not a.quantized
    assert both.nbytes < dropped.nbytes / 2.5  # 192 of 250 kept tokens quantized


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trips(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.uint8)
    packed = _pack(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(_unpack(packed, bits), codes)


def test_empty_and_short_prefixes_are_kept_whole(prefix):
    source, observed, cache = prefix
    short = LocalKVSource(cache, 20)
    out = parse_compressor("snapkv:budget=64+kivi:bits=2").compress(
        short, [q[-20:] for q in observed], LAYERS, KV_HEADS, DIM
    )
    assert all(layer.kept == 20 and not layer.quantized for layer in out.layers)
