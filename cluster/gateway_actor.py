"""The LMCache gateway as a Ray actor: one process per gateway (per deployment, or per
shard), speaking LMCache's `lm://` protocol and storing through the shards as one tenant.

It takes no CPU from Ray's accounting (it relays bytes) and goes where the deployment
places it (the node running `serve` by default, as routers do).
"""

from __future__ import annotations

import os

import ray

from cluster.paths import PRIVATE_UMASK
from prefix_store.lmcache import GatewayConfig


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
class GatewayActor:
    def __init__(self, config: GatewayConfig) -> None:
        os.umask(PRIVATE_UMASK)  # its files (blobs, caches) are the service user's alone
        from prefix_store.lmcache import LMCacheGateway

        self.gateway = LMCacheGateway(config)

    def start(self) -> str:
        """Connect to the store as the configured tenant and serve; returns host:port for
        `remote_url: lm://host:port` (raises GatewayError on an unknown token)."""
        address = self.gateway.start()
        if self.gateway.config.host in ("0.0.0.0", "::"):
            port = address.rsplit(":", 1)[1]
            return f"{ray.util.get_node_ip_address()}:{port}"
        return address

    def stats(self) -> dict[str, int]:
        """What it did: puts, refused puts by reason, hits, misses, protocol errors."""
        return {**self.gateway.stats.snapshot(), "open_connections": self.gateway.connections()}

    def metrics_url(self) -> str:
        """Its Prometheus endpoint ("" when it serves none); on 0.0.0.0 the node's IP."""
        url = self.gateway.metrics_url
        if url and self.gateway.config.host in ("0.0.0.0", "::"):
            url = url.replace(
                f"//{self.gateway.config.host}:", f"//{ray.util.get_node_ip_address()}:"
            )
        return url

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.gateway.stop()


def gateway_actor(config: GatewayConfig, placement: dict | None = None):
    """Create (not start) a gateway actor; `placement` adds Ray options (a node, a name, a
    detached lifetime)."""
    return GatewayActor.options(**(placement or {})).remote(config)
