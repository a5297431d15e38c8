"""A request's prefix identity: what prefix-affine routing places by.

The prefix identity is the store's chunk-key chain (`prefix_store.keys.chunk_keys`: the
same hash, chained from the caller's namespace salt, over the same 256-token chunks) of
the prompt's first `chunks` full chunks (the whole prompt when it has none). Two requests
over one stored prefix in one namespace therefore get one identity, and so one decoder:
its compressed copy and its verification passes serve both. Salts differ per tenant and
namespace, so one tenant's prompts never share (or reveal) another's placement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
TEXT_CHARS_PER_TOKEN = 16
"""Text prompts are tokenized only as far as routing needs: this many characters per
token of the identity's chunks (far more than any tokenizer's average)."""


def prefix_identity(tokens: Sequence[int], salt: bytes, chunks: int) -> int:
    """The routing identity of a prompt: its first `chunks` full chunks' key chain."""
    full = min(chunks, len(tokens) // CHUNK_TOKENS)
    if full == 0:
        return sha256_cbor_64bit(("vericache-route-short", bytes(salt), [int(t) for t in tokens]))
    return chunk_keys(tokens[: full * CHUNK_TOKENS], ROUTE_LAYOUT, salt)[-1]


def request_identity(request, salts: Mapping[str, bytes], tokenizer, chunks: int) -> int:
    """The identity of a Generate or Publish request, in the namespace it names (`salts`:
    the caller's namespaces; an unknown one gets a salt no namespace has, so its decoder
    reports it as NOT_FOUND)."""
    salt = salts.get(request.namespace, b"?" + request.namespace.encode())
    which = request.WhichOneof("prompt")
    if which == "token_ids":
        tokens = list(request.token_ids.ids[: chunks * CHUNK_TOKENS])
    elif which == "text":
        text = request.text[: chunks * CHUNK_TOKENS * TEXT_CHARS_PER_TOKEN]
        tokens = list(tokenizer.encode(text, add_special_tokens=False))
        salt += b"chat" if request.chat else b"text"
    else:
        tokens = []
    return prefix_identity(tokens, salt, chunks)
