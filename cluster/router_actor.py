"""The router as a Ray actor: one process per router, serving gRPC itself.

Routers take no CPU from Ray's accounting (they run no model: they tokenize at most a
prompt's first chunks and relay bytes), and go on the node running `serve`.
"""

from __future__ import annotations

import dataclasses
import os

import ray

from cluster.paths import PRIVATE_UMASK
from decoder.router.config import RouterConfig


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
class RouterActor:
    def __init__(self, config: RouterConfig) -> None:
        os.umask(PRIVATE_UMASK)  # its files (blobs, caches) are the service user's alone
        from decoder.router.server import RouterServer

        if config.host == "0.0.0.0" and config.advertise_host is None:  # HTTP's too
            config = dataclasses.replace(config, advertise_host=ray.util.get_node_ip_address())
        self.server = RouterServer(config)

    def start(self) -> str:
        return self.server.start()

    def set_decoders(self, decoders: list[str]) -> None:
        """The deployment's decoders changed: host:port each."""
        self.server.set_decoders(decoders)

    def decoders(self) -> list[dict]:
        """Each decoder as this router sees it: health, load, requests routed."""
        return self.server.decoders()

    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL ("" when it serves none)."""
        return self.server.http_url

    def metrics_url(self) -> str:
        return self.server.metrics_url

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.server.stop()


def router_actor(config: RouterConfig, placement: dict | None = None):
    """Create (not start) a router actor; `placement` adds Ray options."""
    return RouterActor.options(**(placement or {})).remote(config)
