"""Deployments on a real local Ray (and the session's real redis-server)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.serve import Deployment, ServeConfig
from prefix_store.config import MiB


@contextlib.contextmanager
def deployed(redis_url: str | None, home: Path, **overrides):
    """A running deployment whose state file lives under `home` (VERICACHE_HOME); with
    `redis_url` None, it starts its own Redis there."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VERICACHE_HOME", str(home))
    overrides.setdefault("decoder_threads", 1)  # one torch thread, as every test process
    config = ServeConfig(redis_url=redis_url, state_dir=home / "state", **overrides)
    try:
        with Deployment(config) as deployment:
            yield deployment
    finally:
        mp.undo()


def _shares_service(item: pytest.Item) -> bool:
    """Whether `item` uses this package's `service` (not a module's own of that name)."""
    defs = getattr(item, "_fixtureinfo", None)
    defs = defs.name2fixturedefs.get("service") if defs else None
    return bool(defs) and defs[-1].func is service.__wrapped__


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests sharing `service` run last in this package, those marked `kills_parts` (they
    kill parts of it) last of all. Until then, other modules' deployments start and stop
    their own Ray (one per process: they could not while this one runs), and leaving the
    package stops it at once."""
    here = Path(__file__).parent
    inside = [i for i, item in enumerate(items) if Path(item.path).is_relative_to(here)]
    if not inside:
        return
    first, last = inside[0], inside[-1] + 1
    package = items[first:last]
    sharing = [item for item in package if _shares_service(item)]
    killers = [item for item in sharing if item.get_closest_marker("kills_parts")]
    others = [item for item in package if not _shares_service(item)]
    ordered = others + [item for item in sharing if item not in killers] + killers
    items[first:last] = ordered


@pytest.fixture(scope="package")
def service(tmp_path_factory):
    """The one decoding deployment of tests/cluster, started once and shared by every module
    that only uses it (test_remote_decoding, test_request_isolation): two shards (512 MiB
    memory each, no disk), one decoder, and prefixes never resident, so that every
    verification pulls from the shards (what these tests exercise: pulls, failover,
    recompute; resident prefixes are tested in tests/decoder: test_engine, test_store_source).

    Sharing contract: each test adds its own tenants (names prefixed by its module) and works
    in their namespaces; a test that kills a part of it restarts that part before it ends,
    pass or fail, and is marked `kills_parts` to run after the others. These tests run last
    in the package (`pytest_collection_modifyitems`). It runs its own Redis
    (`redis_url=None`), which the session's `metadata` fixture, emptied for each test, never
    touches. Its router serves the OpenAI-compatible API too. Deployments of another shape
    stay in their modules: test_serve (a disk tier, no decoder), test_router (two decoders,
    one killed), test_lmcache_serve (a gateway), and tests/bench (their own shapes)."""
    home = tmp_path_factory.mktemp("vericache-home")
    with deployed(
        None,
        home,
        shards=2,
        memory_bytes=512 * MiB,
        disk_bytes=0,
        decoders=1,
        resident_prefixes=False,
        http_port=0,
    ) as deployment:
        yield deployment


DRIVER = """
import sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
except Exception as error:
    print("refused:", type(error).__name__)
else:
    print("connected:", int(ray.cluster_resources().get("CPU", 0)))
"""


def driver(address: str, env: dict[str, str], home: Path, timeout_s: float = 120) -> str:
    """What a fresh Ray driver process with `env` (and its own empty home: no token file
    of Ray's own) gets from the cluster at `address`: "connected: N", "refused: ERROR", or
    "timed out" after `timeout_s`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    try:
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, address],
            env={**clean, "HOME": str(home), **env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return "timed out"
    return done.stdout.strip().splitlines()[-1]
