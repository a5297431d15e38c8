"""`accept_length` and `rollback`: the acceptance rule without a model."""

from __future__ import annotations

import pytest
import torch

from decoder.config import ModelConfig
from decoder.engine.speculative import accept_length, rollback
from decoder.kv_cache import KVCache


@pytest.mark.parametrize(
    ("drafts", "choices", "expected"),
    [
        ([], [7], 0),  # nothing drafted: only the verifier's token
        ([1, 2, 3], [1, 2, 3, 4], 3),  # all accepted, plus the bonus choice
        ([1, 2, 3], [1, 9, 3, 4], 1),  # stops at the first mismatch...
        ([1, 2, 3], [9, 2, 3, 4], 0),  # ...even when later drafts happen to match
        ([5, 5, 5], [5, 5, 6, 5], 2),
        ([1, 2], [1, 2], 2),  # the bonus choice is optional
    ],
)
def test_accept_length_is_the_leading_run_of_agreement(drafts, choices, expected):
    assert accept_length(drafts, choices) == expected


def test_accept_length_needs_a_choice_per_draft():
    with pytest.raises(ValueError, match="3 drafts need as many choices"):
        accept_length([1, 2, 3], [1, 2])


class _Round:
    """The parts of a running request that `rollback` touches."""

    def __init__(self, tail: KVCache, draft: KVCache | None) -> None:
        self.tail = tail
        self.draft = draft


class _DraftTail(KVCache):
    """A draft tail with the `DraftCache` interface `rollback` and a draft step use."""

    @property
    def tail_length(self) -> int:
        return len(self)

    def catch_up(self, tail: KVCache) -> None:
        for mine, theirs in zip(self.layers, tail.layers, strict=True):
            start, end = mine.length, theirs.length
            mine.append(theirs.k[:, start:end], theirs.v[:, start:end], theirs.positions[start:end])


def _config() -> ModelConfig:
    return ModelConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )


def _fill(cache: KVCache, values: list[float]) -> None:
    start = len(cache)
    for layer in cache.layers:
        kv = torch.tensor(values).view(1, -1, 1).expand(1, len(values), 4)
        layer.append(kv, -kv, torch.arange(start, start + len(values)))


def test_rollback_keeps_the_verified_kv_of_emitted_tokens_and_mirrors_it_into_the_draft():
    config = _config()
    tail, draft = KVCache(config, granule=32), _DraftTail(config, granule=32)
    _fill(tail, [1.0, 2.0])  # verified before the round
    _fill(draft, [1.0, 2.0])
    _fill(draft, [30.0, 40.0, 50.0])  # the drafts' own (draft-mode) KV
    _fill(tail, [3.0, 4.0, 5.0, 6.0])  # the verification's KV of [last, d1, d2, d3]

    rollback(_Round(tail, draft), before=2, taken=2)  # d1 accepted, then the bonus token

    assert len(tail) == 4 and len(draft) == 2  # the drafts are gone; verified rows wait
    draft.catch_up(tail)  # the next round's first draft step
    assert len(draft) == 4
    for exact, drafted in zip(tail.layers, draft.layers, strict=True):
        assert exact.k[0, :4, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
        assert torch.equal(drafted.k[:, :4], exact.k[:, :4])
        assert torch.equal(drafted.v[:, :4], exact.v[:, :4])
        assert drafted.positions[:4].tolist() == [0, 1, 2, 3]


def test_exact_rounds_leave_the_draft_tail_alone_until_it_drafts_again():
    """Rounds that draft nothing copy no KV into the draft tail; the next draft step mirrors
    every row verified meanwhile, so it drafts over exactly the verified context."""
    config = _config()
    tail, draft = KVCache(config, granule=32), _DraftTail(config, granule=32)
    _fill(tail, [1.0, 2.0])
    _fill(draft, [1.0, 2.0])
    for value in (3.0, 4.0, 5.0):  # three exact steps: each verifies its one input
        before = len(tail)
        _fill(tail, [value])
        rollback(_Round(tail, draft), before=before, taken=1)
        assert len(draft) == 2

    draft.catch_up(tail)

    for exact, drafted in zip(tail.layers, draft.layers, strict=True):
        assert torch.equal(drafted.k[:, :5], exact.k[:, :5])
        assert drafted.positions[:5].tolist() == [0, 1, 2, 3, 4]
