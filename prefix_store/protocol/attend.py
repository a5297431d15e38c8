"""The Attend RPC's bounds and encoding, both ends: a decoder sizes its queries by them and
a shard refuses what exceeds them (see the .proto for the messages)."""

from __future__ import annotations

from prefix_store.layout import MAX_HEADS

MAX_ROWS = 4096
"""Query rows per Attend query (a verification pass's drafted tokens, batched)."""
MAX_QUERY_HEADS = MAX_HEADS
"""Query heads per Attend header."""
MAX_CHUNKS = 1 << 16
"""Chunks per Attend header: the key-list bound of every call."""
FLOAT32 = 4
"""Bytes per element: queries and partials travel as float32."""
