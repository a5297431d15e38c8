"""The engine's scheduling levers and limits, each checked against full-KV decoding:
shared-prefix verification (one read of each prefix layer per pass), continuous batching,
the KV budget (admission waits; a request larger than the budget fails), prefetch, faults
(recompute, or a clear failure with only verified tokens sent) and cancellation."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from decoder.budget import OverBudget
from decoder.engine import (
    Cancelled,
    Engine,
    EngineConfig,
    Prefix,
    Request,
    Unreachable,
    prefill_prefix,
)
from decoder.generate import generate_full
from decoder.kv_source import LocalKVSource

NEW = 16


class CountingSource(LocalKVSource):
    """Host-memory KV that counts layer reads and can start failing (a store going away)."""

    def __init__(self, source: LocalKVSource, fail_after: int | None = None) -> None:
        super().__init__(source._cache, source.length)
        self.reads = 0
        self.fail_after = fail_after

    def read_layer(self, index, k_out, v_out) -> None:
        if self.fail_after is not None and self.reads >= self.fail_after:
            raise ConnectionError("shard lost")
        self.reads += 1
        super().read_layer(index, k_out, v_out)


@pytest.fixture(scope="module")
def doc(builtin_model):
    return builtin_model.encode(inspect.getsource(textwrap))[:520]


@pytest.fixture(scope="module")
def suffixes(builtin_model):
    questions = ["# What does fill do?", "# Summarise.", "# List the classes.", "# Why?"]
    return [builtin_model.encode(f"\n{q}\n")[1:] for q in questions]


@pytest.fixture(scope="module")
def references(builtin_model, builtin_runner, doc, suffixes):
    return [
        r.tokens
        for r in generate_full(
            builtin_runner,
            [doc + s for s in suffixes],
            max_new_tokens=NEW,
            eos_token_ids=builtin_model.eos_token_ids,
        )
    ]


_prefilled: dict[tuple[int, tuple[int, ...]], Prefix] = {}


def fresh_prefix(runner, doc, fail_after=None):
    """A new prefix over `doc` whose source counts reads: its own copy of the KV (and
    observed queries) of one exact prefill per document in this module, the bits a new
    prefill gives (exact mode is deterministic)."""
    key = (id(runner), tuple(doc))
    if key not in _prefilled:
        _prefilled[key] = prefill_prefix(runner, doc)
    base = _prefilled[key]
    source = LocalKVSource(base.source._cache.clone(), base.source.length)
    observed = [q.clone() for q in base.observed] if base.observed is not None else None
    return Prefix(list(base.tokens), CountingSource(source, fail_after), observed)


def engine(runner, model, **config) -> Engine:
    """An engine whose vericache passes pull (no resident copies) unless told otherwise."""
    config.setdefault("horizon", 4)
    config.setdefault("resident", False)
    return Engine(runner, EngineConfig(**config), model.eos_token_ids)


def test_one_prefix_read_per_pass_whatever_the_requests(
    builtin_model, builtin_runner, doc, suffixes, references
):
    prefix = fresh_prefix(builtin_runner, doc)
    e = engine(builtin_runner, builtin_model, stagger=True)
    e.compressed(prefix)  # build the artifact first: it reads the prefix once
    prefix.source.reads = 0
    results = e.run([Request(prefix, s, NEW) for s in suffixes])
    assert [r.tokens for r in results] == references
    passes = 1 + max(r.stats["verifications"] for r in results)  # suffix prefill + verifies
    layers = builtin_model.config.num_layers
    # Requests over one prefix verify together: each pass reads each layer once.
    assert prefix.source.reads == passes * layers
    assert all(r.stats["verifications"] == results[0].stats["verifications"] for r in results)


def test_rounds_over_different_prefixes_are_staggered(
    builtin_model, builtin_runner, doc, suffixes, references
):
    passes = {}
    for stagger in (False, True):
        prefixes = [fresh_prefix(builtin_runner, doc) for _ in range(2)]  # two distinct ones
        e = engine(builtin_runner, builtin_model, horizon=6, stagger=stagger)
        results = e.run([Request(p, s, NEW) for p, s in zip(prefixes, suffixes, strict=False)])
        assert [r.tokens for r in results] == references[:2]
        verifications = [r.stats["verifications"] for r in results]
        passes[stagger] = (e.stats.verify_passes, max(verifications), sum(verifications))
    together, _, _ = passes[False]
    apart, most, total = passes[True]
    # Staggered, their verifications fall in different passes more often than not.
    assert together < apart <= total and most < apart


def test_requests_join_while_others_decode(
    builtin_model, builtin_runner, doc, suffixes, references
):
    prefix = fresh_prefix(builtin_runner, doc)
    e = engine(builtin_runner, builtin_model)
    first = e.submit(Request(prefix, suffixes[0], NEW))
    e.step()
    e.step()
    assert not first.done
    streamed: list[int] = []
    second = e.submit(Request(prefix, suffixes[1], NEW), on_tokens=streamed.extend)
    while not (first.done and second.done):
        e.step()
    assert first.wait().tokens == references[0]
    assert second.wait().tokens == references[1] == streamed


@pytest.mark.parametrize("mode", ["full", "vericache"])
def test_admission_waits_for_room_under_the_budget(
    builtin_model, builtin_runner, doc, suffixes, references, mode
):
    prefixes = [fresh_prefix(builtin_runner, doc) for _ in suffixes]  # distinct prefixes
    probe = engine(builtin_runner, builtin_model, mode=mode)
    probe.run([Request(prefixes[0], suffixes[0], NEW)])
    one = probe.budget.peak
    limit = int(one * 2.5)  # room for two requests at a time, not four
    e = engine(builtin_runner, builtin_model, mode=mode, kv_budget=limit)
    results = e.run([Request(p, s, NEW) for p, s in zip(prefixes, suffixes, strict=True)])
    assert [r.tokens for r in results] == references
    assert one < e.budget.peak <= limit
    assert max(r.stats["queue_s"] for r in results) > 0  # some waited for room
    assert e.budget.used == 0


def test_requests_that_will_not_draft_are_served_as_full_kv_would_serve_them(
    builtin_model, builtin_runner, doc, suffixes, references
):
    """Horizon 0 (no drafting) over four distinct prefixes, with resident copies allowed and
    a budget for about two requests: each prefix is read once and held, as full-KV decoding
    holds it, and the other requests wait for room, instead of being admitted on their
    compressed copies to pull their prefix for every token. The same requests with
    resident copies off pull once per pass. Tokens identical to full KV either way."""
    prefixes = [fresh_prefix(builtin_runner, doc) for _ in suffixes]  # distinct prefixes
    probe = engine(builtin_runner, builtin_model, horizon=0, resident=True)
    probe.run([Request(prefixes[0], suffixes[0], NEW)])
    one = probe.budget.peak
    held = engine(builtin_runner, builtin_model, horizon=0, resident=True, kv_budget=int(one * 2.5))
    results = held.run([Request(p, s, NEW) for p, s in zip(prefixes, suffixes, strict=True)])
    assert [r.tokens for r in results] == references
    nbytes = prefixes[0].source.nbytes
    assert [r.stats["pulled_bytes"] for r in results] == [nbytes] * 4  # read once, then held
    assert all(r.stats["resident_prefix"] for r in results)
    assert max(r.stats["queue_s"] for r in results) > 0  # some waited for room
    assert held.budget.used == 0

    pulling = engine(builtin_runner, builtin_model, horizon=0, resident=False)
    results = pulling.run([Request(p, s, NEW) for p, s in zip(prefixes, suffixes, strict=True)])
    assert [r.tokens for r in results] == references
    assert all(r.stats["pulled_bytes"] >= (NEW - 1) * nbytes for r in results)


def test_a_request_larger_than_the_budget_fails_clearly(builtin_model, builtin_runner, doc):
    prefix = fresh_prefix(builtin_runner, doc)
    e = engine(builtin_runner, builtin_model, mode="full", kv_budget=1 << 20)
    with pytest.raises(OverBudget, match="budget is 1048576 bytes"):
        e.run([Request(prefix, [13], NEW)])


def test_lost_prefix_is_recomputed_bitwise(
    builtin_model, builtin_runner, doc, suffixes, references
):
    layers = builtin_model.config.num_layers
    # vericache: mid-way through the first verification; full: while pulling the prefix
    for mode, fail_after in (("vericache", layers + 7), ("full", 3)):
        prefix = fresh_prefix(builtin_runner, doc)
        e = engine(builtin_runner, builtin_model, mode=mode)
        if mode != "full":
            e.compressed(prefix)
            prefix.source.reads = 0
        prefix.source.fail_after = fail_after
        results = e.run([Request(prefix, s, NEW) for s in suffixes[:2]])
        assert [r.tokens for r in results] == references[:2], mode
        assert all(r.stats["recomputed"] for r in results), mode


def test_no_recompute_room_fails_unavailable_after_verified_tokens_only(
    builtin_model, builtin_runner, doc, suffixes, references
):
    prefix = fresh_prefix(builtin_runner, doc)
    probe = engine(builtin_runner, builtin_model)
    probe.compressed(prefix)
    probe.run([Request(prefix, suffixes[0], NEW)])
    e = engine(builtin_runner, builtin_model, kv_budget=probe.budget.peak + (1 << 20))
    prefix.source.reads = 0
    prefix.source.fail_after = 3 * builtin_model.config.num_layers + 5
    sent: list[int] = []
    ticket = e.submit(Request(prefix, suffixes[0], NEW), on_tokens=sent.extend)
    while not ticket.done:
        e.step()
    with pytest.raises(Unreachable, match="unreachable .*shard lost.*no unverified token"):
        ticket.wait()
    assert sent and sent == references[0][: len(sent)]
    assert e.budget.used == 0


def test_cancelled_requests_end_and_free_their_budget(builtin_model, builtin_runner, doc):
    prefix = fresh_prefix(builtin_runner, doc)
    e = engine(builtin_runner, builtin_model, kv_budget=1 << 30)
    ticket = e.submit(Request(prefix, [13], 200))
    e.step()
    ticket.cancel()
    e.step()
    with pytest.raises(Cancelled):
        ticket.wait()
    assert e.budget.used == 0 and not e.busy


def test_the_next_pass_is_prefetched_while_drafting(
    builtin_model, builtin_runner, doc, suffixes, references
):
    prefix = fresh_prefix(builtin_runner, doc)
    e = engine(builtin_runner, builtin_model, staging_depth=3)
    result = e.run([Request(prefix, suffixes[2], NEW)])[0]
    assert result.tokens == references[2]
    stats = e.ring.stats
    assert stats.layers >= builtin_model.config.num_layers * 2
    assert stats.read_s > 0 and result.stats["peak_staging_bytes"] > 0


def test_a_queued_request_can_be_cancelled_behind_one_waiting_for_room(
    builtin_model, builtin_runner, doc
):
    prefixes = [fresh_prefix(builtin_runner, doc) for _ in range(3)]
    probe = engine(builtin_runner, builtin_model, mode="full")
    probe.run([Request(prefixes[0], [13], NEW)])
    e = engine(builtin_runner, builtin_model, mode="full", kv_budget=int(probe.budget.peak * 1.5))
    running = e.submit(Request(prefixes[0], [13], NEW))
    e.step()
    waiting = e.submit(Request(prefixes[1], [13], NEW))  # head of the queue: no room yet
    behind = e.submit(Request(prefixes[2], [13], NEW))
    behind.cancel()
    e.step()
    assert behind.done and not waiting.done and not running.done
    with pytest.raises(Cancelled):
        behind.wait()
    while not waiting.done:
        e.step()
    assert running.wait().tokens == waiting.wait().tokens
    assert e.budget.used == 0


@pytest.mark.parametrize("max_bypass, smalls_admitted", [(0, 0), (1, 1), (8, 2)])
def test_a_request_waiting_for_room_is_passed_by_smaller_ones_a_bounded_number_of_times(
    builtin_model, builtin_runner, doc, max_bypass, smalls_admitted
):
    big = [fresh_prefix(builtin_runner, doc) for _ in range(2)]
    small = [fresh_prefix(builtin_runner, doc[:16]) for _ in range(2)]
    peaks = []
    for prefix in (big[0], small[0]):
        probe = engine(builtin_runner, builtin_model, mode="full")
        probe.run([Request(prefix, [13], NEW)])
        peaks.append(probe.budget.peak)
    limit = peaks[0] + 2 * peaks[1] + (64 << 10)  # one big and both small ones, not two big
    assert limit < 2 * peaks[0]
    e = engine(builtin_runner, builtin_model, mode="full", kv_budget=limit, max_bypass=max_bypass)
    tickets = [e.submit(Request(big[0], [13], NEW))]
    e.step()
    tickets.append(e.submit(Request(big[1], [13], NEW), tenant="a"))  # waits for room
    tickets += [e.submit(Request(p, [13], NEW), tenant="b") for p in small]
    e.step()
    assert e.in_flight == 1 + smalls_admitted and e.queued == 3 - smalls_admitted
    while not all(t.done for t in tickets):
        e.step()
    prompts = [p.tokens + [13] for p in big + small]
    eos = builtin_model.eos_token_ids
    full = generate_full(builtin_runner, prompts, max_new_tokens=NEW, eos_token_ids=eos)
    assert [t.wait().tokens for t in tickets] == [r.tokens for r in full]
    assert e.budget.used == 0
