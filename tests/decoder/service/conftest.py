"""Decoder service fixtures: a real store shard over the session's Redis, and decoder
servers with the built-in model on loopback."""

from __future__ import annotations

import pytest

from decoder.service.config import DecoderConfig
from decoder.service.server import DecoderServer
from decoder.service.worker import DecoderWorker
from prefix_store.config import ClientConfig
from tests.prefix_store.conftest import Store


def serve(endpoints, model, **overrides) -> DecoderServer:
    """A started decoder server over the shards at `endpoints`, serving an already loaded
    model; `overrides` are DecoderConfig fields. The caller stops it."""
    overrides.setdefault("client", ClientConfig(timeout_s=10, retries=2, backoff_s=0.05))
    config = DecoderConfig(tuple(endpoints), **overrides)
    server = DecoderServer(config, DecoderWorker(config, model=model))
    server.start()
    return server


@pytest.fixture
def store(metadata, redis_server, tmp_path):
    """One shard on loopback."""
    store = Store(redis_server.url, tmp_path)
    store.start()
    yield store
    store.close()
