"""Who a client places chunks on, and who it avoids: the shard set over time, damped
against flapping, and the quarantine of shards that failed recently. No I/O: the clients
feed in what Describe said and what failed, and read back a `Topology`.

The flap rule (`Membership`): the first Describe admits every shard it lists. After that,
each refresh
- dials every listed shard at the address listed now (a shard restarted on a new address
  is used at once, and its quarantine, earned at the old address, ends);
- keeps a shard no longer listed in the placement set for `ClientConfig.membership_grace_s`,
  marked absent: routed around like a quarantined shard (its replicas serve), then dropped
  if it stays unlisted that long;
- admits a newly listed shard to the placement set once it has been listed for
  `membership_grace_s` (until then it is given no chunks).
So a shard that vanishes and returns within the grace moves no chunk, and a shard that
joins moves only the keys rendezvous hashing gives it, once. Thread-safe.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from prefix_store.client.plan import Topology
from prefix_store.config import ClientConfig
from prefix_store.errors import Unavailable


@dataclass(slots=True)
class Membership:
    """The placement set a client hashes over, updated by `observe(Describe response)`."""

    grace_s: float
    topology: Topology | None = None
    absent: dict[str, float] = field(default_factory=dict)
    """Members not listed by the last Describe -> since when."""
    pending: dict[str, float] = field(default_factory=dict)
    """Listed shards not yet admitted -> when first listed."""

    def observe(self, described: Topology, now: float) -> Topology:
        """The topology after a Describe that said `described`."""
        if self.topology is None:
            if not described.shards:
                raise Unavailable("the store has no live shards")
            self.topology = described
            return described
        shards = dict(self.topology.shards)
        data = dict(self.topology.data_addresses)
        kernels = dict(self.topology.attention_kernels)
        listed = (shards, data, kernels)
        for shard_id in list(shards):
            if shard_id in described.shards:
                self._listed(shard_id, described, *listed)
            elif now - self.absent.setdefault(shard_id, now) >= self.grace_s:
                self._drop(shard_id, *listed)
        for shard_id in described.shards.keys() - shards.keys():
            if now - self.pending.setdefault(shard_id, now) >= self.grace_s:
                self._listed(shard_id, described, *listed)
        self.pending = {s: p for s, p in self.pending.items() if s in described.shards}
        self.topology = replace(
            described,
            shards=shards,
            data_addresses=data,
            attention_kernels=kernels,
            replication=self._replication(described, len(shards)),
            absent=frozenset(self.absent),
        )
        return self.topology

    def next_change(self) -> float | None:
        """When a pending shard or an absent one is next due to be admitted or dropped."""
        times = [*self.pending.values(), *self.absent.values()]
        return min(times) + self.grace_s if times else None

    def _listed(
        self, shard_id: str, described: Topology, shards: dict, data: dict, kernels: dict
    ) -> None:
        """Admit a listed shard at its current address, data plane and attention kernel."""
        self.absent.pop(shard_id, None)
        self.pending.pop(shard_id, None)
        shards[shard_id] = described.shards[shard_id]
        for known, said in (
            (data, described.data_addresses),
            (kernels, described.attention_kernels),
        ):
            known.pop(shard_id, None)
            if shard_id in said:
                known[shard_id] = said[shard_id]

    def _drop(self, shard_id: str, shards: dict, data: dict, kernels: dict) -> None:
        self.absent.pop(shard_id, None)
        for known in (shards, data, kernels):
            known.pop(shard_id, None)

    def _replication(self, described: Topology, members: int) -> int:
        """Describe's factor, which counts only listed shards: while a member is absent the
        previous factor stands, so its chunks keep their owners."""
        factor = described.replication
        if self.absent:
            factor = max(factor, self.topology.replication)
        return max(1, min(factor, members))


class Quarantine:
    """Shards that failed recently -> until when (monotonic) calls and transfers prefer
    their replicas. Thread-safe."""

    def __init__(self, config: ClientConfig) -> None:
        self.seconds = config.quarantine_s
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, shard_id: str, now: float) -> None:
        with self._lock:
            self._until[shard_id] = now + self.seconds

    def clear(self, shard_id: str) -> None:
        with self._lock:
            self._until.pop(shard_id, None)

    def active(self, now: float) -> frozenset[str]:
        with self._lock:
            return frozenset(s for s, until in self._until.items() if until > now)
