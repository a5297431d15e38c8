"""The shard as a Ray actor: one process per shard, serving gRPC itself.

Shards need the custom resource `storage` (one unit each), so Ray places them only on
nodes that advertise it: storage nodes on a cluster, this machine in the embedded default.
"""

from __future__ import annotations

import dataclasses
import os

import ray

from cluster.paths import PRIVATE_UMASK
from cluster.roles import STORAGE_RESOURCE  # noqa: E402,F401 - re-exported
from prefix_store import faults
from prefix_store.config import ShardConfig


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
class ShardActor:
    def __init__(self, config: ShardConfig, redis_url: str) -> None:
        os.umask(PRIVATE_UMASK)  # its files (blobs, caches) are the service user's alone
        if config.host == "0.0.0.0" and config.advertise_host is None:
            config = dataclasses.replace(config, advertise_host=ray.util.get_node_ip_address())
        from prefix_store.server import ShardServer  # in the actor: its driver needs no torch

        self.server = ShardServer(config, redis_url)

    def start(self) -> str:
        """Serve and join the membership; returns the address clients dial."""
        return self.server.start()

    def stats(self) -> dict:
        return self.server.servicer.shard_stats()

    def metrics_url(self) -> str:
        """Its Prometheus endpoint ("" when it serves none)."""
        return self.server.metrics_url

    def pid(self) -> int:
        """The actor's process (operators: memory, signals; `make chaos`)."""
        return os.getpid()

    def inject_transit_faults(self, frames: int) -> int:
        """Fault injection (`make chaos`): corrupt the next `frames` fetched layers or
        messages on their way out (`prefix_store.faults`; 0 disarms). Returns how many
        were corrupted so far."""
        faults.TRANSIT.arm(frames)
        return faults.TRANSIT.fired

    def inject_attend_faults(self, answers: int) -> int:
        """Fault injection (`make chaos`): corrupt the next `answers` Attend answers (the
        partials of one near-data query each) on their way out (0 disarms). Returns how
        many were corrupted so far."""
        faults.ATTEND.arm(answers)
        return faults.ATTEND.fired

    def stop(self) -> None:
        """Graceful: leave the membership, finish RPCs, persist memory to disk."""
        self.server.stop()


def shard_actor(config: ShardConfig, redis_url: str, placement: dict | None = None):
    """Create (not start) a shard actor on a node with the storage resource; `placement`
    adds Ray options (a node, a name, a detached lifetime)."""
    options = {"resources": {STORAGE_RESOURCE: 1}, **(placement or {})}
    return ShardActor.options(**options).remote(config, redis_url)
