"""Hypothesis profiles for the fuzz suite (one module per parser family).

"ci" (default): a bounded number of examples per property, so that the whole suite runs in
about a minute on 2 cores; no example database is written. "long": hour-scale runs
(`make fuzz`, or VERICACHE_FUZZ=long), keeping what it finds in .hypothesis/ so that a
failure found once is replayed first next time. VERICACHE_FUZZ_EXAMPLES overrides the
examples per property of either profile."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

SLOW_OK = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.function_scoped_fixture,  # fixtures here hand out fresh state per example
]

settings.register_profile(
    "ci", max_examples=100, deadline=None, database=None, suppress_health_check=SLOW_OK
)
settings.register_profile("long", max_examples=20_000, deadline=None, suppress_health_check=SLOW_OK)
PROFILE = os.environ.get("VERICACHE_FUZZ", "ci")
settings.load_profile(PROFILE)
if os.environ.get("VERICACHE_FUZZ_EXAMPLES"):
    settings.register_profile(
        "sized",
        parent=settings.get_profile(PROFILE),
        max_examples=int(os.environ["VERICACHE_FUZZ_EXAMPLES"]),
    )
    settings.load_profile("sized")


@pytest.fixture(scope="module")
def shard(redis_server, tmp_path_factory):
    """One real shard (gRPC and data plane) on loopback over the session's Redis, shared by
    a module's examples, and the token of a tenant "fuzz" with room to store."""
    import redis

    from prefix_store.metadata import Metadata
    from tests.prefix_store.conftest import Store

    redis.Redis.from_url(redis_server.url).flushdb()
    store = Store(redis_server.url, tmp_path_factory.mktemp("shards"))
    store.start()
    token = Metadata(redis_server.url).add_tenant("fuzz", 1 << 30)
    yield store, token
    store.close()
