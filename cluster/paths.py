"""Where a deployment keeps its files on each host (no heavy imports: the CLI's fast path).

Everything under `home()` is the service user's alone: directories 0700, files 0600
(`private_umask`), since the state file holds the Redis password and the state directory
holds the provenance key, the internal credential, the Ray token and tenants' blobs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

PRIVATE_UMASK = 0o077
"""What the service's processes create is readable by the service's user alone."""


def home() -> Path:
    """The deployment's directory on this host (`$VERICACHE_HOME`, else ~/.vericache)."""
    return Path(os.environ.get("VERICACHE_HOME", Path.home() / ".vericache"))


def state_file() -> Path:
    return home() / "cluster.json"


def state_dir() -> Path:
    """Redis data, shard disk tiers, the provenance key and the internal credential (per
    host)."""
    return home() / "state"


def provenance_key_file(directory: Path | None = None) -> Path:
    """The deployment's Ed25519 key (0600): decoders sign with it, shards hold its public half."""
    return Path(directory or state_dir()) / "provenance.key"


def internal_token_file(directory: Path | None = None) -> Path:
    """The deployment's internal credential (0600): routers present it to read decoders'
    Info (`decoder.internal`)."""
    return Path(directory or state_dir()) / "internal.token"


def make_private(path: Path) -> Path:
    """Create directory `path` (and parents) as 0700, tightening it if it exists wider."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Files and directories made in the block are the owner's alone."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)
