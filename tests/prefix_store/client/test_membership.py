"""The flap rule, without I/O: what a client places on as Describe answers change."""

from __future__ import annotations

from prefix_store.client.membership import Membership
from prefix_store.client.plan import Topology


def described(*shards: str, replication: int = 2) -> Topology:
    """A Describe listing `shards` ("id@address" or "id")."""
    listed = dict(s.split("@") if "@" in s else (s, f"{s}:1") for s in shards)
    return Topology("alice", {"": b"salt"}, listed, min(replication, len(listed)), {})


def test_a_shard_that_vanishes_within_the_grace_keeps_its_placement():
    view = Membership(grace_s=10)
    first = view.observe(described("a", "b"), now=0)
    gone = view.observe(described("a"), now=1)
    assert gone.shards == first.shards and gone.absent == {"b"} and gone.replication == 2
    assert gone.owners(123) == first.owners(123)  # no chunk moves
    back = view.observe(described("a", "b@b:2"), now=5)
    assert back.absent == frozenset() and back.shards["b"] == "b:2"  # its new address


def test_a_shard_unlisted_for_the_grace_leaves_the_placement_set():
    view = Membership(grace_s=10)
    view.observe(described("a", "b"), now=0)
    view.observe(described("a"), now=1)
    assert view.next_change() == 11
    after = view.observe(described("a"), now=11)
    assert set(after.shards) == {"a"} and after.replication == 1


def test_a_joining_shard_is_placed_on_only_once_listed_for_the_grace():
    view = Membership(grace_s=10)
    view.observe(described("a", "b"), now=0)
    assert set(view.observe(described("a", "b", "c"), now=1).shards) == {"a", "b"}
    assert view.observe(described("a", "b"), now=2).shards.keys() == {"a", "b"}  # flapped
    assert set(view.observe(described("a", "b", "c"), now=3).shards) == {"a", "b"}
    assert set(view.observe(described("a", "b", "c"), now=13).shards) == {"a", "b", "c"}
