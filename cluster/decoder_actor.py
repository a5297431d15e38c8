"""The decoder worker as a Ray actor: one process per worker, serving gRPC itself.

Decoders ask for one GPU where the cluster has GPUs (DESIGN.md section 7) and for one CPU
otherwise; their torch threads are set explicitly, because Ray caps an actor's OpenMP
threads at its CPU request.
"""

from __future__ import annotations

import dataclasses
import os

import ray

from cluster.paths import PRIVATE_UMASK
from cluster.roles import DECODER_RESOURCE  # noqa: E402,F401 - re-exported
from decoder.service.config import DecoderConfig


@ray.remote(max_restarts=0, max_concurrency=4)
class DecoderActor:
    def __init__(self, config: DecoderConfig) -> None:
        os.umask(PRIVATE_UMASK)  # its files (blobs, caches) are the service user's alone
        from decoder.service.server import DecoderServer

        if config.host == "0.0.0.0" and config.advertise_host is None:
            config = dataclasses.replace(config, advertise_host=ray.util.get_node_ip_address())
        if config.threads is None:
            config = dataclasses.replace(config, threads=os.cpu_count() or 1)
        self.server = DecoderServer(config)

    def start(self) -> str:
        return self.server.start()

    def info(self) -> dict:
        info = self.server.worker.info()
        return {"worker_id": info.worker_id, "kv_used": info.kv_used, "in_flight": info.in_flight}

    def stop(self) -> None:
        self.server.stop()

    def metrics_url(self) -> str:
        """Its Prometheus endpoint ("" when it serves none)."""
        return self.server.metrics_url

    def pid(self) -> int:
        """The actor's process (operators: memory, signals; `make chaos`)."""
        return os.getpid()


def decoder_actor(config: DecoderConfig, gpus: bool, placement: dict | None = None):
    """Create (not start) a decoder actor: one GPU when `gpus` (its node has some), else one
    CPU; `placement` adds Ray options (a decoder node, a name, a detached lifetime)."""
    options = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    return DecoderActor.options(**options, **(placement or {})).remote(config)
