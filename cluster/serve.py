"""`vericache serve`: the service on a Ray cluster, or the embedded default on this machine.

Embedded (no Ray address): a local Ray instance, a local `redis-server`, N shard actors and
M decoder actors. With an address: shard actors on that cluster's storage nodes, decoders
on its GPU nodes (any node when there are none), Redis at `redis_url`.
Either way the endpoints and the Redis URL are written to a state file, so that
`vericache tenant`, `status` and clients on this machine find the service.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from cluster.decoder_actor import decoder_actor
from cluster.redis_server import RedisServer
from cluster.store_actor import STORAGE_RESOURCE, shard_actor
from decoder.service.config import DEFAULT_COMPRESSOR, DecoderConfig
from prefix_store.config import GiB, ShardConfig
from prefix_store.metadata import Metadata

log = logging.getLogger(__name__)


def home() -> Path:
    return Path(os.environ.get("VERICACHE_HOME", Path.home() / ".vericache"))


def state_file() -> Path:
    return home() / "cluster.json"


def read_state() -> dict:
    """What the running `vericache serve` on this machine wrote (endpoints, redis_url)."""
    path = state_file()
    if not path.exists():
        raise FileNotFoundError(
            f"no running service found ({path} missing): start one with `vericache serve`, "
            "or pass --redis-url / --endpoint"
        )
    return json.loads(path.read_text())


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """The store deployment."""

    address: str | None = None
    """Ray cluster address ("auto" on a cluster node); None = embedded on this machine."""
    shards: int = 2
    redis_url: str | None = None
    """Existing Redis; None = start the embedded one (embedded mode only)."""
    host: str = "127.0.0.1"
    """Bind address of the shards (0.0.0.0 to be reachable from other hosts)."""
    port: int = 0
    """First shard gRPC port (shard i listens on port + i); 0 = free ports."""
    data_port: int = 0
    """First shard data-plane port (shard i on data_port + i); 0 = free ports."""
    memory_bytes: int = 2 * GiB
    """Memory tier per shard."""
    disk_bytes: int = 8 * GiB
    """Disk tier per shard (0 = none)."""
    state_dir: Path = field(default_factory=lambda: home() / "state")
    """Redis data and shard disk tiers (per node)."""
    replication: int | None = None
    """Copies per chunk; None = 2 when there are two or more shards."""
    decoders: int = 1
    """Decoder workers (0 = the store alone)."""
    decoder_port: int = 0
    """First decoder gRPC port (decoder i on decoder_port + i); 0 = free ports."""
    kv_budget: int | None = None
    """KV bytes per decoder worker (None = unlimited)."""
    compressor: str = DEFAULT_COMPRESSOR
    """Default compressor spec of the decoders."""
    decoder_threads: int | None = None
    """torch threads per decoder (None: the node's cores)."""

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError("shards: must be >= 1")
        if self.decoders < 0:
            raise ValueError("decoders: must be >= 0")
        if self.address is not None and self.redis_url is None:
            raise ValueError("redis_url: required when deploying onto a Ray cluster")
        if self.replication is not None and not 1 <= self.replication <= self.shards:
            raise ValueError(f"replication: must be in [1, {self.shards}]")

    def shard(self, index: int) -> ShardConfig:
        return ShardConfig(
            shard_id=f"shard-{index}",
            memory_bytes=self.memory_bytes,
            disk_bytes=self.disk_bytes,
            disk_dir=Path(self.state_dir) / "shards" / f"shard-{index}",
            host=self.host,
            port=self.port + index if self.port else 0,
            data_port=self.data_port + index if self.data_port else 0,
        )

    def decoder(self, index: int, store_endpoints: list[str]) -> DecoderConfig:
        return DecoderConfig(
            store_endpoints=tuple(store_endpoints),
            host=self.host,
            port=self.decoder_port + index if self.decoder_port else 0,
            worker_id=f"decoder-{index}",
            kv_budget=self.kv_budget,
            default_compressor=self.compressor,
            threads=self.decoder_threads,
        )


class Deployment:
    """Starts and stops the store. Use as a context manager, or start()/stop()."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.redis: RedisServer | None = None
        self.redis_url = config.redis_url
        self.actors: dict[int, object] = {}
        self.endpoints: dict[int, str] = {}
        self.decoder_actors: dict[int, object] = {}
        self.decoders: dict[int, str] = {}
        """Decoder endpoints (host:port) clients use for Generate and Publish."""
        self._owns_ray = False

    def start(self) -> Deployment:
        """Start everything; on any failure, stop what did start and re-raise."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Deployment:
        if self.redis_url is None:
            self.redis = RedisServer(Path(self.config.state_dir) / "redis").start()
            self.redis_url = self.redis.url
        metadata = Metadata(self.redis_url)
        metadata.ping()
        if self.config.replication:
            metadata.set_replication(self.config.replication)
        self._init_ray()
        for index in range(self.config.shards):
            self.start_shard(index)
        for index in range(self.config.decoders):
            self.start_decoder(index)
        self._write_state()
        return self

    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        if self.config.address is None:
            ray.init(
                num_cpus=max(2, os.cpu_count() or 2),
                resources={STORAGE_RESOURCE: self.config.shards},
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        else:
            ray.init(address=self.config.address, log_to_driver=False)
        self._owns_ray = True

    def start_shard(self, index: int) -> str:
        """(Re)start shard `index`; it finds its disk tier again."""
        actor = shard_actor(self.config.shard(index), self.redis_url, name=None)
        address = ray.get(actor.start.remote(), timeout=120)
        self.actors[index], self.endpoints[index] = actor, address
        return address

    def start_decoder(self, index: int) -> str:
        stores = [self.endpoints[i] for i in sorted(self.endpoints)]
        actor = decoder_actor(self.config.decoder(index, stores))
        address = ray.get(actor.start.remote(), timeout=300)
        self.decoder_actors[index], self.decoders[index] = actor, address
        return address

    def kill_shard(self, index: int) -> None:
        """Kill a shard's process abruptly (no flush, no deregistration): a crash."""
        ray.kill(self.actors.pop(index))
        self.endpoints.pop(index, None)

    def stop_shard(self, index: int) -> None:
        """Stop a shard gracefully (its memory tier is persisted to disk first)."""
        actor = self.actors.pop(index)
        self.endpoints.pop(index, None)
        try:
            ray.get(actor.stop.remote(), timeout=60)
        finally:
            ray.kill(actor)

    def stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.actors.values()], timeout=30)

    def _write_state(self) -> None:
        state = {
            "endpoints": [self.endpoints[i] for i in sorted(self.endpoints)],
            "decoders": [self.decoders[i] for i in sorted(self.decoders)],
            "redis_url": self.redis_url,
            "ray_address": self.config.address or "embedded",
            "started": time.time(),
            "pid": os.getpid(),
        }
        state_file().parent.mkdir(parents=True, exist_ok=True)
        state_file().write_text(json.dumps(state, indent=2))

    def stop(self) -> None:
        for index, actor in list(self.decoder_actors.items()):
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except Exception as error:  # noqa: BLE001 - keep shutting the rest down
                log.warning("decoder %d did not stop cleanly: %s", index, error)
            ray.kill(actor)
        self.decoder_actors.clear()
        self.decoders.clear()
        for index in list(self.actors):
            try:
                self.stop_shard(index)
            except Exception as error:  # noqa: BLE001 - keep shutting the rest down
                log.warning("shard %d did not stop cleanly: %s", index, error)
        if self._owns_ray:
            ray.shutdown()
        if self.redis is not None:
            self.redis.stop()
        try:
            if json.loads(state_file().read_text()).get("pid") == os.getpid():
                state_file().unlink()
        except (OSError, ValueError):
            pass

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
