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
def deployed(redis_url: str, home: Path, **overrides):
    """A running deployment whose state file lives under `home` (VERICACHE_HOME)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VERICACHE_HOME", str(home))
    config = ServeConfig(redis_url=redis_url, state_dir=home / "state", **overrides)
    try:
        with Deployment(config) as deployment:
            yield deployment
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def service(redis_server, tmp_path_factory, request):
    """A module's deployment: two shards (512 MiB memory each, no disk) and one decoder. A
    module sets `SERVICE = {...}` for other ServeConfig fields."""
    home = tmp_path_factory.mktemp("vericache-home")
    overrides = getattr(request.module, "SERVICE", {})
    with deployed(
        redis_server.url,
        home,
        shards=2,
        memory_bytes=512 * MiB,
        disk_bytes=0,
        decoders=1,
        **overrides,
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


def driver(address: str, env: dict[str, str], home: Path) -> str:
    """What a fresh Ray driver process with `env` (and its own empty home: no token file
    of Ray's own) gets from the cluster at `address`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, address],
        env={**clean, "HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout.strip().splitlines()[-1]
