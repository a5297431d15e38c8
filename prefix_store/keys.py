"""Chained chunk keys, by LMCache's chunked prefix hashing.

The key of chunk i is hash((key of chunk i-1, tokens of chunk i, ())), the scheme of
LMCache's `ChunkedTokenDatabase` (a partial last chunk gets a key too); the hash is vLLM's
`sha256_cbor_64bit` (SHA-256 over canonical CBOR, first 8 bytes big-endian), never Python's
`hash()`. The chain starts from a seed that hashes the model identity, the KV layout, the
chunk size and the namespace salt, so two namespaces (tenants) never share keys for the
same tokens. Keys identify; they do not prove: a hit is always confirmed against the
stored tokens.

The chain is written out here rather than run through LMCache's class: importing
`lmcache.v1.token_database` imports `transformers`, about 1.7 CPU-seconds at the start of
every shard, decoder and client process. tests/prefix_store/test_keys.py checks the keys
against LMCache's own `ChunkedTokenDatabase`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import cbor2

from prefix_store.layout import KVLayout

KEY_VERSION = "vericache-keys-v1"


def sha256_cbor_64bit(value: object) -> int:
    """vLLM's `sha256_cbor_64bit`: SHA-256 of canonical CBOR, first 8 bytes as an int."""
    digest = hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()
    return int.from_bytes(digest[:8], "big")


def chain_seed(layout: KVLayout, salt: bytes) -> int:
    """The parent key of a prefix's first chunk."""
    return sha256_cbor_64bit((KEY_VERSION, list(layout.identity()), bytes(salt)))


def chunk_keys(tokens: Sequence[int], layout: KVLayout, salt: bytes) -> list[int]:
    """Keys of every chunk of `tokens` (the last one may be partial), in order."""
    ids = [int(t) for t in tokens]
    size = layout.chunk_tokens
    keys, parent = [], chain_seed(layout, salt)
    for start in range(0, len(ids), size):
        parent = sha256_cbor_64bit((parent, tuple(ids[start : start + size]), ()))
        keys.append(parent)
    return keys


def parent_keys(keys: Sequence[int], layout: KVLayout, salt: bytes) -> list[int]:
    """The parent of each chunk: the seed for chunk 0, else the previous chunk's key."""
    return [chain_seed(layout, salt), *keys[:-1]]
