"""Shared-prefix attention: requests over one prefix buffer in one exact forward.

Their rows attend to the prefix's full key chunks in one stacked kernel call, then each
continues over its own chunks; every request's logits and KV must be bitwise what they are
when it runs alone, and what a plain dense cache of the same tokens gives.
"""

from __future__ import annotations

import pytest
import torch

from decoder.config import ModelConfig, RunnerConfig
from decoder.kv_cache import KVCache
from decoder.runner import ModelRunner, SeqInput
from decoder.views import SharedPrefixView
from decoder.weights import random_weights

CONFIG = ModelConfig(
    vocab_size=400,
    hidden_size=96,
    intermediate_size=160,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
)
CHUNK = 32

pytestmark = pytest.mark.fused_kernel  # skips only where the CPU cannot run it


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(CONFIG, random_weights(CONFIG, seed=4), RunnerConfig(key_chunk=CHUNK))


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


class Requests:
    """Requests over one prefix: a shared buffer holding it, a tail per request."""

    def __init__(self, runner: ModelRunner, prefix: torch.Tensor, tails: list[torch.Tensor]):
        self.runner = runner
        self.prefix_length = prefix.numel()
        room = max(t.numel() for t in tails) + 16
        self.buffer = runner.new_cache(capacity=self.prefix_length + room)
        runner.forward([SeqInput.extend(self.buffer, prefix, "none")])
        self.tails = [runner.new_cache() for _ in tails]
        for i, tail in enumerate(tails):  # each request's own tokens after the prefix
            if tail.numel():
                runner.forward([SeqInput.extend(self.view(i, None), tail, "none")])

    def view(self, i: int, prefix_id: object | None) -> SharedPrefixView:
        buffer = self.buffer

        def layers(index: int) -> object:
            return buffer.layers[index]

        return SharedPrefixView(layers, self.prefix_length, self.tails[i], prefix_id=prefix_id)

    def snapshot(self) -> list[KVCache]:
        return [t.clone() for t in self.tails]

    def restore(self, tails: list[KVCache]) -> None:
        self.tails = [t.clone() for t in tails]


def dense(runner: ModelRunner, prefix, tail, new) -> tuple[torch.Tensor, KVCache]:
    """The same tokens over a plain cache: logits of `new` and the cache."""
    cache = runner.new_cache()
    runner.forward([SeqInput.extend(cache, torch.cat([prefix, tail]), "none")])
    return runner.forward([SeqInput.extend(cache, new, "all")])[0], cache


@pytest.mark.parametrize("prefix_length", [64, 75, 95, 20])  # on/off chunk boundaries, < 1 chunk
def test_requests_together_equal_each_alone(runner, prefix_length):
    prefix = tokens(prefix_length, 1)
    tails = [tokens(n, 10 + n) for n in (0, 5, 40, 13)]
    new = [tokens(n, 20 + n) for n in (1, 4, 7, 3)]
    requests = Requests(runner, prefix, tails)
    before = requests.snapshot()

    shared = object()
    together = runner.forward(
        [SeqInput.extend(requests.view(i, shared), x, "all") for i, x in enumerate(new)]
    )
    tails_together = requests.snapshot()

    for i, x in enumerate(new):
        requests.restore(before)
        alone = runner.forward([SeqInput.extend(requests.view(i, None), x, "all")])[0]
        assert torch.equal(together[i], alone), f"request {i}: logits differ"
        for layer, (a, b) in enumerate(
            zip(tails_together[i].layers, requests.tails[i].layers, strict=True)
        ):
            n = a.length
            assert n == b.length
            assert torch.equal(a.k[:, :n], b.k[:, :n]), f"request {i} layer {layer}: keys"
            assert torch.equal(a.v[:, :n], b.v[:, :n]), f"request {i} layer {layer}: values"
        want, cache = dense(runner, prefix, tails[i], x)
        assert torch.equal(alone, want), f"request {i}: differs from a dense cache"
        start = prefix_length
        for a, b in zip(requests.tails[i].layers, cache.layers, strict=True):
            n = a.length
            assert torch.equal(a.k[:, :n], b.k[:, start : start + n])


def test_stacked_with_other_sequences_and_two_prefixes(runner):
    """Two prefix groups and a plain sequence in one forward: each result is its own."""
    first = Requests(runner, tokens(70, 2), [tokens(3, 3), tokens(9, 4)])
    second = Requests(runner, tokens(40, 5), [tokens(0, 6), tokens(33, 7), tokens(1, 8)])
    plain = runner.new_cache()
    runner.forward([SeqInput.extend(plain, tokens(50, 9), "none")])
    saved = (first.snapshot(), second.snapshot(), plain.clone())
    a, b = object(), object()
    seqs = [
        SeqInput.extend(second.view(0, b), tokens(2, 30), "all"),
        SeqInput.extend(first.view(0, a), tokens(5, 31), "all"),
        SeqInput.extend(plain, tokens(4, 32), "all"),
        SeqInput.extend(second.view(2, b), tokens(6, 33), "all"),
        SeqInput.extend(first.view(1, a), tokens(1, 34), "all"),
        SeqInput.extend(second.view(1, b), tokens(3, 35), "all"),
    ]
    together = runner.forward(seqs)
    first.restore(saved[0])
    second.restore(saved[1])
    plain = saved[2]
    alone_views = [
        (second, 0, 30, 2),
        (first, 0, 31, 5),
        (None, None, 32, 4),
        (second, 2, 33, 6),
        (first, 1, 34, 1),
        (second, 1, 35, 3),
    ]
    for j, (requests, i, seed, n) in enumerate(alone_views):
        cache = plain if requests is None else requests.view(i, None)
        alone = runner.forward([SeqInput.extend(cache, tokens(n, seed), "all")])[0]
        assert torch.equal(together[j], alone), f"sequence {j}"


def test_stacking_is_used(runner, monkeypatch):
    """The stacked path really runs: one prefix call for the group, per layer."""
    import decoder.runner as runner_module

    calls = []
    real = runner_module.attend_chunks

    def spy(q, *args, **kwargs):
        calls.append((q.shape[0], kwargs.get("first_chunk", 0), kwargs.get("stop_chunk")))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(runner_module, "attend_chunks", spy)
    requests = Requests(runner, tokens(80, 1), [tokens(2, 2), tokens(4, 3)])
    calls.clear()
    shared = object()
    runner.forward(
        [SeqInput.extend(requests.view(i, shared), tokens(3, 4 + i), "all") for i in range(2)]
    )
    per_layer = [(6, 0, 2), (3, 2, None), (3, 2, None)]
    assert calls == per_layer * CONFIG.num_layers
