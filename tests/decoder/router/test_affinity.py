"""Routing decisions alone: prefix identity, rendezvous order, bounded loads."""

from __future__ import annotations

from collections import Counter

from decoder.router.identity import CHUNK_TOKENS, prefix_identity
from decoder.router.policies import Load
from decoder.router.policies.affinity import choose, rendezvous

DECODERS = ["10.0.0.1:7200", "10.0.0.2:7200", "10.0.0.3:7200"]


def test_a_prefix_identity_is_its_first_chunks_in_its_namespace():
    doc = list(range(1000, 1000 + 2 * CHUNK_TOKENS))
    one = prefix_identity(doc + [1, 2, 3], b"salt-a", chunks=2)
    assert one == prefix_identity(doc + [7] * 300, b"salt-a", chunks=2)  # same first 2 chunks
    assert one != prefix_identity(doc + [1, 2, 3], b"salt-b", chunks=2)  # another namespace
    assert one != prefix_identity([5] + doc, b"salt-a", chunks=2)
    short = prefix_identity([1, 2, 3], b"salt-a", chunks=2)  # no full chunk: all of it
    assert short != prefix_identity([1, 2, 4], b"salt-a", chunks=2)


def test_rendezvous_order_is_stable_and_moves_little_when_decoders_change():
    keys = range(2000)
    before = {k: rendezvous(k, DECODERS)[0] for k in keys}
    assert before == {k: rendezvous(k, list(reversed(DECODERS)))[0] for k in keys}
    spread = Counter(before.values())
    assert all(500 < n < 830 for n in spread.values())  # about a third each
    after = {k: rendezvous(k, DECODERS[:2])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == DECODERS[2] for k in moved)  # only the removed one's keys move


def test_bounded_loads_spill_a_burst_and_keep_affinity_otherwise():
    identity = 42
    first = rendezvous(identity, DECODERS[:2])[0]
    other = next(d for d in DECODERS[:2] if d != first)
    loads = {d: Load() for d in DECODERS[:2]}
    placed = []
    for _ in range(4):  # a burst of 4 over one prefix, none finishing
        target = choose(identity, loads, factor=1.25)[0]
        placed.append(target)
        loads[target] = Load(loads[target].requests + 1)
    assert placed[:2] == [first, first] and other in placed[2:]
    assert max(n.requests for n in loads.values()) <= 3  # ceil(1.25 * 4 / 2)


def test_a_nearly_full_decoder_is_tried_last():
    identity = 7
    first = rendezvous(identity, DECODERS)[0]
    loads = {d: Load() for d in DECODERS}
    loads[first] = Load(0, budget_use=0.99)
    assert choose(identity, loads, 1.25)[-1] == first
    assert choose(identity, {}, 1.25) == []
