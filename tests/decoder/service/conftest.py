"""Decoder service helpers: decoder servers with the built-in model on loopback (the store
shard they serve from is `store`, in tests/decoder/conftest.py)."""

from __future__ import annotations

from decoder.service.config import DecoderConfig
from decoder.service.server import DecoderServer
from decoder.service.worker import DecoderWorker
from prefix_store.config import ClientConfig


def serve(endpoints, model, **overrides) -> DecoderServer:
    """A started decoder server over the shards at `endpoints`, serving an already loaded
    model; `overrides` are DecoderConfig fields. The caller stops it."""
    overrides.setdefault("client", ClientConfig(timeout_s=10, retries=2, backoff_s=0.05))
    config = DecoderConfig(tuple(endpoints), **overrides)
    server = DecoderServer(config, DecoderWorker(config, model=model))
    server.start()
    return server
