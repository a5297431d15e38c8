"""Deployments on a real local Ray (and the session's real redis-server)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from cluster.serve import Deployment, ServeConfig


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
