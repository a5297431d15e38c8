"""Chunk keys: LMCache's chained chunk hashing (checked against LMCache's own code), seeded
per model, layout and namespace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prefix_store.keys import chain_seed, chunk_keys, sha256_cbor_64bit
from prefix_store.layout import KVLayout

LAYOUT = KVLayout("m@1", "float32", 30, 3, 64, chunk_tokens=256)
TOKENS = list(range(1000, 1700))
# sha256_cbor_64bit over (seed, tokens 1000..1255, ()) with the chain seeded by
# ("vericache-keys-v1", layout identity, b"salt"); changing the scheme orphans stored chunks.
PINNED_FIRST_KEY = 6793825831648491323


def test_keys_chain_over_chunks_and_keep_a_partial_last_chunk():
    keys = chunk_keys(TOKENS, LAYOUT, b"salt")
    assert len(keys) == 3  # 256 + 256 + 188
    assert all(0 <= k < 2**64 for k in keys)
    # A chunk's key depends on everything before it: change token 0, every key changes.
    changed = chunk_keys([7] + TOKENS[1:], LAYOUT, b"salt")
    assert all(a != b for a, b in zip(keys, changed, strict=True))
    # Tokens after a chunk do not change its key.
    assert chunk_keys(TOKENS[:512], LAYOUT, b"salt") == keys[:2]


@pytest.mark.parametrize("chunk_tokens", [16, 256])
@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 255, 256, 257, 700])
def test_keys_match_lmcache_chunked_token_database_with_the_same_hash(chunk_tokens, length):
    """Our keys are what LMCache's ChunkedTokenDatabase computes with sha256_cbor_64bit
    and the chain seeded by our namespace seed, partial last chunk included."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    layout = KVLayout("m@1", "float32", 30, 3, 64, chunk_tokens=chunk_tokens)
    tokens = [(7919 * i) % 49152 for i in range(length)]
    database = ChunkedTokenDatabase.__new__(ChunkedTokenDatabase)
    database.config, database.metadata, database.save_only_first_rank = None, None, False
    database.chunk_size = chunk_tokens
    database.hash_func = sha256_cbor_64bit
    seed = chain_seed(layout, b"salt")
    database._get_init_hash = lambda: seed
    expected = [key for _, _, key in database.process_tokens(tokens, make_key=False)]
    assert chunk_keys(tokens, layout, b"salt") == expected


@pytest.mark.parametrize(
    "other",
    [
        dict(salt=b"other"),
        dict(layout=KVLayout("m@2", "float32", 30, 3, 64)),
        dict(layout=KVLayout("m@1", "float16", 30, 3, 64)),
        dict(layout=KVLayout("m@1", "float32", 30, 3, 64, chunk_tokens=128)),
    ],
)
def test_namespace_salt_model_layout_and_chunk_size_seed_the_keys(other):
    base = chunk_keys(TOKENS[:256], LAYOUT, b"salt")
    changed = chunk_keys(TOKENS[:256], other.get("layout", LAYOUT), other.get("salt", b"salt"))
    assert base[0] != changed[0]


def test_keys_are_pinned_and_do_not_depend_on_python_hash_seed():
    """Never Python's hash(): another process with another PYTHONHASHSEED agrees, and the
    value is pinned so that a change of scheme cannot go unnoticed."""
    code = (
        "from prefix_store.keys import chunk_keys; from prefix_store.layout import KVLayout;"
        "print(chunk_keys(list(range(1000, 1700)), KVLayout('m@1','float32',30,3,64), b'salt'))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(chunk_keys(TOKENS, LAYOUT, b"salt"))
    assert chunk_keys(TOKENS[:256], LAYOUT, b"salt")[0] == PINNED_FIRST_KEY
