"""Decoder fixtures shared by the service and router tests: the store they serve from."""

from __future__ import annotations

import pytest

from tests.prefix_store.conftest import Store


@pytest.fixture
def store(metadata, redis_server, tmp_path):
    """One shard on loopback, over the session's Redis."""
    store = Store(redis_server.url, tmp_path)
    store.start()
    yield store
    store.close()
