"""The client SDK loads no store server module, not even through a shared one: a program
that only reads and writes prefixes imports none of the shard, its server, data plane,
tiers, Attend sessions, the LMCache gateway or the gRPC server toolkit. (`make lint`
checks the SDK's own imports; this checks what they pull in.)"""

from __future__ import annotations

import subprocess
import sys

SERVER_SIDE = (
    "prefix_store.server",
    "prefix_store.shard",
    "prefix_store.data_plane",
    "prefix_store.tiers",
    "prefix_store.attend",
    "prefix_store.lmcache",
    "rpc",
)

PROBE = f"""
import sys
import prefix_store.client, prefix_store.client.aio, prefix_store.client.sync
server_side = {SERVER_SIDE!r}
print(sorted(m for m in sys.modules if m.split(".")[0] == "rpc" or
             any(m == s or m.startswith(s + ".") for s in server_side)))
"""


def test_the_client_sdk_loads_no_server_module():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"
