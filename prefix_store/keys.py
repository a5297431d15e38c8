"""Chained chunk keys, computed with LMCache's chunked prefix hashing.

The key of chunk i is hash((key of chunk i-1, tokens of chunk i, ())), the scheme of
LMCache's `ChunkedTokenDatabase`; the hash is vLLM's `sha256_cbor_64bit` (SHA-256 over
canonical CBOR, first 8 bytes big-endian), never Python's `hash()`. The chain starts from
a seed that hashes the model identity, the KV layout, the chunk size and the namespace
salt, so two namespaces (tenants) never share keys for the same tokens.
Keys identify; they do not prove: a hit is always confirmed against the stored tokens.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence

import cbor2

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
from lmcache.v1.token_database import ChunkedTokenDatabase  # noqa: E402

from prefix_store.layout import KVLayout  # noqa: E402

logging.getLogger("lmcache").setLevel(logging.WARNING)

KEY_VERSION = "vericache-keys-v1"


def sha256_cbor_64bit(value: object) -> int:
    """vLLM's `sha256_cbor_64bit`: SHA-256 of canonical CBOR, first 8 bytes as an int."""
    digest = hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()
    return int.from_bytes(digest[:8], "big")


def chain_seed(layout: KVLayout, salt: bytes) -> int:
    """The parent key of a prefix's first chunk."""
    return sha256_cbor_64bit((KEY_VERSION, list(layout.identity()), bytes(salt)))


class _SeededChunkDatabase(ChunkedTokenDatabase):
    """LMCache's chunked token database with our hash and a per-namespace chain seed."""

    def __init__(self, chunk_tokens: int, seed: int) -> None:
        # The base constructor only picks a hash function (probing for vLLM, falling back
        # to Python's hash() with warnings); we set the state it would set, our hash included.
        self.config = None
        self.metadata = None
        self.save_only_first_rank = False
        self.chunk_size = chunk_tokens
        self.hash_func = sha256_cbor_64bit
        self._seed = seed

    def _get_init_hash(self) -> int:
        return self._seed


def chunk_keys(tokens: Sequence[int], layout: KVLayout, salt: bytes) -> list[int]:
    """Keys of every chunk of `tokens` (the last one may be partial), in order."""
    database = _SeededChunkDatabase(layout.chunk_tokens, chain_seed(layout, salt))
    ids = [int(t) for t in tokens]
    return [key for _, _, key in database.process_tokens(ids, make_key=False)]


def parent_keys(keys: Sequence[int], layout: KVLayout, salt: bytes) -> list[int]:
    """The parent of each chunk: the seed for chunk 0, else the previous chunk's key."""
    return [chain_seed(layout, salt), *keys[:-1]]
