"""The state file the running `vericache serve` on this machine writes (endpoints, Redis URL),
as the commands that talk to it read it: without importing the deployment's code (Ray, the
model runtime), so that `vericache tenant add` and the like start in a fraction of a second.
"""

from __future__ import annotations

import json

from cluster.config_file import ConfigError
from cluster.paths import state_file


def read_state() -> dict:
    """What the running `vericache serve` on this machine wrote (endpoints, redis_url)."""
    path = state_file()
    if not path.exists():
        raise FileNotFoundError(
            f"no running service found ({path} missing): start one with `vericache serve`, "
            "or pass --redis-url / --endpoint"
        )
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as error:
        raise ConfigError(f"{path}: not a state file ({type(error).__name__})") from None
    if not _well_formed(state):
        raise ConfigError(f"{path}: not a state file as `vericache serve` writes it")
    return state


STATE_TYPES = {"endpoints": list, "decoders": list, "routers": list, "http": list, "metrics": dict}
STATE_TYPES |= {"lmcache": str, "redis_url": str, "tls": str, "metrics_token": str}
"""The state file's fields that commands read, and their types (lists and dicts of str)."""


def _well_formed(state) -> bool:
    if not isinstance(state, dict):
        return False
    for name, kind in STATE_TYPES.items():
        value = state.get(name, kind())
        if not isinstance(value, kind):
            return False
        items = value.values() if kind is dict else value if kind is list else ()
        if not all(isinstance(item, str) for item in items):
            return False
    return True
