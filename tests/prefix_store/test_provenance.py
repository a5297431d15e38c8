"""Provenance (docs/DESIGN.md section 8): shards check decoders' signatures, keep them with
the chunks and answer lookups with proofs; only signed chunks are trusted by a decoder's
key; unsigned puts never displace signed chunks; fetches are pinned to the looked-up bytes.
Real shards on loopback over the session's Redis; signatures made with real Ed25519 keys."""

from __future__ import annotations

import pytest
import torch

from prefix_store.client.plan import as_layers, chunk_digests
from prefix_store.errors import InvalidArgument, StoreError
from prefix_store.provenance import (
    Proof,
    Signer,
    check_chunk,
    chunk_statement,
    token_digests,
    trusted_prefix,
)
from tests.prefix_store.conftest import LAYOUT, random_kv

TOKENS = list(range(100, 140))  # chunks of 16 + 16 + 8 tokens
SPEC = "snapkv:budget=0.125"


@pytest.fixture
def deployment_key():
    return Signer.generate()


@pytest.fixture
def signed_store(store, deployment_key):
    """Two shards (replication 2) holding the deployment's public key."""
    for shard_id in ("shard-0", "shard-1"):
        store.start(shard_id, provenance_key=deployment_key.verifier.public_bytes)
    return store


@pytest.fixture
def token(metadata):
    return metadata.add_tenant("alice")


def fetched(client, prefix) -> torch.Tensor:
    k = torch.empty(LAYOUT.num_layers, LAYOUT.num_kv_heads, prefix.tokens, LAYOUT.head_dim)
    v = torch.empty_like(k)
    client.fetch_layers(prefix, k, v)
    return torch.stack([k, v], dim=1)


def test_a_signed_publish_is_trusted_and_its_proofs_name_the_stored_bytes(
    signed_store, token, deployment_key
):
    kv = random_kv(LAYOUT, len(TOKENS))
    with signed_store.client(token) as client:
        client.publish_prefix(TOKENS, kv, LAYOUT, signer=deployment_key)
        found = client.lookup(TOKENS, LAYOUT)
        assert found.tokens == len(TOKENS)
        assert trusted_prefix(found, TOKENS, deployment_key.verifier) == found
        layers = as_layers(kv, LAYOUT, len(TOKENS))
        assert [c.proof.digest for c in found.chunks] == chunk_digests(layers, found.chunks)
        assert torch.equal(fetched(client, found), kv)


def test_a_signature_of_another_key_is_refused_and_nothing_is_stored(signed_store, token):
    with signed_store.client(token) as client:
        with pytest.raises(InvalidArgument, match="signature does not verify"):
            client.publish_prefix(
                TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT, signer=Signer.generate()
            )
        assert client.lookup(TOKENS, LAYOUT).tokens == 0


def test_unsigned_kv_is_never_trusted_and_a_signed_publish_replaces_it(
    signed_store, token, deployment_key
):
    forged, real = random_kv(LAYOUT, len(TOKENS), seed=1), random_kv(LAYOUT, len(TOKENS))
    with signed_store.client(token) as client:
        client.publish_prefix(TOKENS, forged, LAYOUT)  # a raw SDK put: unsigned
        found = client.lookup(TOKENS, LAYOUT)
        assert found.tokens == len(TOKENS)  # still a plain KV store for the SDK
        assert torch.equal(fetched(client, found), forged)
        assert trusted_prefix(found, TOKENS, deployment_key.verifier).tokens == 0

        client.publish_prefix(TOKENS, real, LAYOUT, signer=deployment_key)
        found = client.lookup(TOKENS, LAYOUT)
        assert trusted_prefix(found, TOKENS, deployment_key.verifier).tokens == len(TOKENS)
        assert torch.equal(fetched(client, found), real)


def test_an_unsigned_put_never_replaces_a_signed_chunk(signed_store, token, deployment_key):
    real = random_kv(LAYOUT, len(TOKENS))
    with signed_store.client(token) as client:
        client.publish_prefix(TOKENS, real, LAYOUT, signer=deployment_key)
        client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS), seed=2), LAYOUT)
        found = client.lookup(TOKENS, LAYOUT)
        assert trusted_prefix(found, TOKENS, deployment_key.verifier) == found
        assert torch.equal(fetched(client, found), real)


def test_a_fetch_serves_only_the_bytes_its_lookup_named(signed_store, token, deployment_key):
    with signed_store.client(token) as client:
        client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT, signer=deployment_key)
        looked_up = client.lookup(TOKENS, LAYOUT)
        client.delete_prefix(TOKENS, LAYOUT)
        client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS), seed=3), LAYOUT)
        with pytest.raises(StoreError, match="digest"):
            fetched(client, looked_up)


def test_a_proof_binds_every_token_before_the_chunk(deployment_key):
    """The same chunk tokens after a different beginning are a different statement: the KV
    of a chunk depends on the whole prefix before it."""
    digest = bytes(32)
    first = token_digests(TOKENS, [32])[0]
    other = token_digests([7, *TOKENS[1:]], [32])[0]
    proof = Proof(digest, deployment_key.sign(chunk_statement(LAYOUT, first, digest)))
    assert check_chunk(deployment_key.verifier, LAYOUT, first, proof)
    assert not check_chunk(deployment_key.verifier, LAYOUT, other, proof)
    assert not check_chunk(deployment_key.verifier, LAYOUT, first, Proof(bytes([1]) * 32))
    assert not check_chunk(Signer.generate().verifier, LAYOUT, first, proof)


def test_token_digests_do_not_depend_on_the_order_asked():
    forward = token_digests(TOKENS, [16, 32, 40])
    assert token_digests(TOKENS, [40, 16, 32]) == [forward[2], forward[0], forward[1]]


def test_artifacts_are_signed_checked_and_never_downgraded(signed_store, token, deployment_key):
    with signed_store.client(token) as client:
        prefix = client.publish_prefix(
            TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT, signer=deployment_key
        ).prefix
        client.put_artifact(prefix, SPEC, b"unsigned draft bytes")
        assert client.fetch_artifact(prefix, SPEC) == b"unsigned draft bytes"
        assert client.fetch_artifact(prefix, SPEC, deployment_key.verifier) is None
        with pytest.raises(InvalidArgument, match="signature does not verify"):
            client.put_artifact(prefix, SPEC, b"x", signer=Signer.generate())
        client.put_artifact(prefix, SPEC, b"signed draft bytes", signer=deployment_key)
        assert client.fetch_artifact(prefix, SPEC, deployment_key.verifier) == b"signed draft bytes"
        with pytest.raises(InvalidArgument, match="unsigned one cannot replace it"):
            client.put_artifact(prefix, SPEC, b"downgrade")
        assert client.fetch_artifact(prefix, SPEC, deployment_key.verifier) == b"signed draft bytes"


def test_signatures_survive_a_restart_from_the_disk_tier(store, token, deployment_key):
    key = deployment_key.verifier.public_bytes
    store.start("shard-0", provenance_key=key, disk_bytes=1 << 20)
    with store.client(token) as client:
        client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT, signer=deployment_key)
    store.stop("shard-0")  # graceful: the memory tier is written to disk
    store.start("shard-0", provenance_key=key, disk_bytes=1 << 20)
    with store.client(token) as client:
        found = client.lookup(TOKENS, LAYOUT)
        assert found.tokens == len(TOKENS)
        assert trusted_prefix(found, TOKENS, deployment_key.verifier) == found


def test_a_shard_without_the_key_keeps_signatures_unchecked(store, token, deployment_key):
    """Decoders still check them: a signature of another key is stored but never trusted."""
    store.start("shard-0")
    with store.client(token) as client:
        client.publish_prefix(
            TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT, signer=Signer.generate()
        )
        found = client.lookup(TOKENS, LAYOUT)
        assert found.tokens == len(TOKENS)
        assert trusted_prefix(found, TOKENS, deployment_key.verifier).tokens == 0


def test_a_signed_put_replacing_the_callers_own_unsigned_chunks_is_not_charged_twice(
    store, metadata, deployment_key
):
    store.start("shard-0", provenance_key=deployment_key.verifier.public_bytes)
    token = metadata.add_tenant("tight", LAYOUT.chunk_bytes(len(TOKENS)))  # one copy fits
    with store.client(token) as client:
        client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS), seed=4), LAYOUT)
        client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT, signer=deployment_key)
        found = client.lookup(TOKENS, LAYOUT)
        assert trusted_prefix(found, TOKENS, deployment_key.verifier) == found
