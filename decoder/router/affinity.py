"""Which decoder serves a request: rendezvous hashing of its prefix identity over the live
decoders, with bounded loads.

The prefix identity is the store's chunk-key chain (`prefix_store.keys.chunk_keys`: the
same hash, chained from the caller's namespace salt, over the same 256-token chunks) of
the prompt's first `chunks` full chunks (the whole prompt when it has none). Two requests
over one stored prefix in one namespace therefore get one identity, and so one decoder:
its compressed copy and its verification passes serve both. Salts differ per tenant and
namespace, so one tenant's prompts never share (or reveal) another's placement.

Bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads",
2018): with m requests in flight over n live decoders, no decoder takes a new request
while it holds ceil(factor * (m + 1) / n) or more; the request goes to the next decoder in
its rendezvous order instead. A decoder whose KV budget is nearly used up is tried last.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prefix_store.keys import chunk_keys, sha256_cbor_64bit
from prefix_store.layout import KVLayout

CHUNK_TOKENS = 256
"""The store's chunk size: the unit of prefix identity."""
ROUTE_LAYOUT = KVLayout(
    "vericache-route", "float32", num_layers=1, num_kv_heads=1, head_dim=1,
    chunk_tokens=CHUNK_TOKENS,
)  # fmt: skip
"""The layout the router's chunk keys are chained under (the chain needs one; routing
needs no model)."""
FULL_BUDGET = 0.95
"""KV budget use beyond which a decoder is tried after all others."""


def prefix_identity(tokens: Sequence[int], salt: bytes, chunks: int) -> int:
    """The routing identity of a prompt: its first `chunks` full chunks' key chain."""
    full = min(chunks, len(tokens) // CHUNK_TOKENS)
    if full == 0:
        return sha256_cbor_64bit(("vericache-route-short", bytes(salt), [int(t) for t in tokens]))
    return chunk_keys(tokens[: full * CHUNK_TOKENS], ROUTE_LAYOUT, salt)[-1]


def rendezvous(identity: int, decoders: Sequence[str]) -> list[str]:
    """`decoders` in the identity's rendezvous order (highest random weight first)."""

    def weight(decoder: str) -> bytes:
        return hashlib.sha256(f"{identity}:{decoder}".encode()).digest()

    return sorted(decoders, key=weight, reverse=True)


@dataclass(frozen=True)
class Load:
    """What a decoder holds now: requests in flight or queued, and its KV budget use."""

    requests: int = 0
    budget_use: float = 0.0


def choose(identity: int, loads: Mapping[str, Load], factor: float) -> list[str]:
    """The live decoders in the order to try them for a request of `identity`: its
    rendezvous order, decoders at their load bound (and nearly full ones) moved behind."""
    order = rendezvous(identity, list(loads))
    if not order:
        return []
    total = sum(load.requests for load in loads.values())
    bound = math.ceil(factor * (total + 1) / len(order))

    def rank(decoder: str) -> int:
        load = loads[decoder]
        return (load.requests >= bound) + 2 * (load.budget_use >= FULL_BUDGET)

    return sorted(order, key=rank)  # stable: rendezvous order within each rank
