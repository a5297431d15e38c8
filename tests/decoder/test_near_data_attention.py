"""Near-data attention in the runner: a prefix's leading chunks attended through partials
(as shards compute them), the rest from a buffer holding only the prefix's last partial
chunk and the tail. Logits and KV must be bitwise those of a plain dense cache."""

from __future__ import annotations

import pytest
import torch

from decoder.config import RunnerConfig
from decoder.kv_cache import KVCache, LayerKV
from decoder.runner import ModelRunner, SeqInput
from decoder.views import SharedPrefixView
from decoder.weights import random_weights
from numerics.cpu.partials import chunk_partials
from tests.decoder.test_shared_prefix_attention import CHUNK, CONFIG, tokens

pytestmark = pytest.mark.fused_kernel  # skips only where the CPU cannot run it


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(CONFIG, random_weights(CONFIG, seed=9), RunnerConfig(key_chunk=CHUNK))


class LocalShards:
    """What the shards do, over a prefix cache held here: partials of chunks below base."""

    def __init__(self, prefix: KVCache, base: int, fail_at_layer: int | None = None) -> None:
        self.prefix, self.base, self.fail_at_layer = prefix, base, fail_at_layer
        self.calls: list[tuple[int, int]] = []
        self.started: list[tuple[int, int]] = []

    def start(self, layer: int, q: torch.Tensor) -> None:
        """Where the shards would start computing (the runner starts every stack first)."""
        self.started.append((layer, q.shape[0]))

    def partials(self, layer: int, q: torch.Tensor):
        if layer == self.fail_at_layer:
            raise ConnectionError("shard gone")
        self.calls.append((layer, q.shape[0]))
        kv = self.prefix.layers[layer]
        n = self.base // CHUNK
        keys = [kv.k[:, c * CHUNK : (c + 1) * CHUNK] for c in range(n)]
        values = [kv.v[:, c * CHUNK : (c + 1) * CHUNK] for c in range(n)]
        return chunk_partials(q, keys, values)


def near_view(runner, prefix_cache: KVCache, length: int, base: int, tail: KVCache, remote):
    buffer = LayerKV(CONFIG.num_kv_heads, CONFIG.head_dim, CHUNK, length - base + 64)

    def layers(index: int) -> LayerKV:
        source = prefix_cache.layers[index]
        buffer.k[:, : length - base] = source.k[:, base:length]
        buffer.v[:, : length - base] = source.v[:, base:length]
        return buffer

    return SharedPrefixView(layers, length, tail, prefix_id=remote, base=base, remote=remote)


@pytest.mark.parametrize("length", [3 * CHUNK + 5, 4 * CHUNK, CHUNK + 31])
def test_near_data_rows_are_bitwise_a_dense_cache(runner, length):
    prefix = tokens(length, seed=length)
    prefix_cache = runner.new_cache()
    runner.forward([SeqInput.extend(prefix_cache, prefix, "none")])
    base = (length // CHUNK) * CHUNK
    shards = LocalShards(prefix_cache, base)
    tails_in = [tokens(7, 1), tokens(3, 2)]
    news = [tokens(5, 3), tokens(9, 4)]
    tails = [runner.new_cache() for _ in tails_in]
    for tail, own in zip(tails, tails_in, strict=True):  # each request's suffix, near-data
        view = near_view(runner, prefix_cache, length, base, tail, shards)
        runner.forward([SeqInput.extend(view, own, "none")])
    views = [near_view(runner, prefix_cache, length, base, t, shards) for t in tails]
    got = runner.forward([SeqInput.extend(v, n, "all") for v, n in zip(views, news, strict=True)])
    # the stacked pass asked the shards once per layer, for every request's rows together
    assert shards.calls[-2:] == [(0, 14), (1, 14)]
    assert shards.started[-2:] == shards.calls[-2:]  # sent before any member waited

    for i in range(2):
        dense = runner.new_cache()
        runner.forward([SeqInput.extend(dense, torch.cat([prefix, tails_in[i]]), "none")])
        want = runner.forward([SeqInput.extend(dense, news[i], "all")])[0]
        assert torch.equal(got[i], want)
        for layer in range(CONFIG.num_layers):
            own = dense.layers[layer]
            n = len(tails[i])
            assert torch.equal(tails[i].layers[layer].k[:, :n], own.k[:, length : length + n])


def test_a_remote_failure_escapes_the_forward(runner):
    length = 2 * CHUNK + 3
    prefix_cache = runner.new_cache()
    runner.forward([SeqInput.extend(prefix_cache, tokens(length, 5), "none")])
    shards = LocalShards(prefix_cache, 2 * CHUNK, fail_at_layer=1)
    view = near_view(runner, prefix_cache, length, 2 * CHUNK, runner.new_cache(), shards)
    with pytest.raises(ConnectionError):
        runner.forward([SeqInput.extend(view, tokens(4, 6), "all")])
