"""Ray's token authentication for a deployment (docs/DESIGN.md section 8).

Whoever can talk to a Ray cluster's GCS runs code as the service's user: reads the
provenance key, signs forged KV. So every Ray node and driver of a deployment runs with
`RAY_AUTH_MODE=token`, reading the token from a 0600 file (never an argument or a
variable holding the token itself):

- the head's `vericache node start --head` generates the token into `token_file()` unless
  the operator put one there (or named another with `--ray-token-file`);
- `ray up` copies it to each worker host (`cluster_synced_files` in cluster/*.yaml), whose
  `vericache node start` refuses to start without it;
- `vericache serve` (embedded or on a cluster) and `vericache stop` use the same file.

Rotation: write a new token into the head's file, copy it to every host (`ray up` again
does), and restart Ray on every host (`ray up --restart-only`); then restart `serve`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from cluster.paths import home, make_private
from prefix_store.errors import InvalidArgument

TOKEN_FILE_ENV = "VERICACHE_RAY_TOKEN_FILE"
"""Names the token file instead of ~/.vericache/ray_token (the file, not the token)."""
TOKEN_BYTES = 32


def token_file(path: str | Path | None = None) -> Path:
    """The Ray token's file: `path`, else $VERICACHE_RAY_TOKEN_FILE, else <home>/ray_token."""
    chosen = path or os.environ.get(TOKEN_FILE_ENV) or home() / "ray_token"
    return Path(chosen).expanduser()


def provision_token(path: Path) -> Path:
    """The head: make sure `path` holds a token, readable by its owner alone. An existing
    token is kept (the operator's, or the one `ray up` copied), its mode tightened."""
    make_private(path.parent)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(TOKEN_BYTES))
    return require_token(path)


def require_token(path: Path) -> Path:
    """A host or driver joining a cluster: `path` must hold a token; its mode is tightened
    to 0600 if it is wider."""
    if not path.is_file():
        raise InvalidArgument(
            f"Ray token file {path} missing: the cluster requires Ray's token authentication; "
            "copy the head's file here (`ray up` does, with cluster_synced_files) or give "
            f"--ray-token-file / ${TOKEN_FILE_ENV}"
        )
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    if not path.read_text().strip():
        raise InvalidArgument(f"Ray token file {path} is empty")
    return path


def auth_environment(path: Path) -> dict[str, str]:
    """What Ray's processes need to require (servers) and present (clients) the token."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def use_token(path: Path) -> None:
    """Turn token authentication on for this process (a Ray driver) and what it starts.
    Ray reads its mode when it is imported, so its cached configuration is refreshed."""
    os.environ.update(auth_environment(path))
    import ray._raylet as raylet  # Ray's own way to refresh (authentication_token_setup)

    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()
