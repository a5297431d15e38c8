"""What a put computes as a chunk's bytes arrive (`ArrivalCheck`): each layer's CRC-32C and
the chunk's digest equal those of its layer-major bytes however the layers and pieces
come; CRC-32C combining; a proof kept from the previous statement format counts as
unsigned, so a signed put replaces it. A real shard, no servers."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_store.blob import Blob, combined_crc, crc32c, crc32c_combine
from prefix_store.config import ShardConfig
from prefix_store.keys import chunk_keys, parent_keys
from prefix_store.namespace import Namespace
from prefix_store.provenance import (
    PROOF_FORMAT,
    Signer,
    chunk_statement,
    content_digest,
    token_digests,
)
from prefix_store.shard import Shard
from prefix_store.shard.arrival import ArrivalCheck
from prefix_store.shard.blobs import chunk_id, is_signed, proof_of
from tests.prefix_store.conftest import LAYOUT

SPACE = Namespace("tenant:a", "", b"salt-a")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combining_two_crcs_is_the_crc_of_both_back_to_back(a, b):
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_combining_holds_for_segment_sized_lengths():
    for size in (1, 4096, 393_216):
        a, b = os.urandom(1000), os.urandom(size)
        assert crc32c_combine(crc32c(a), crc32c(b), size) == crc32c(a + b)


def arrive(check: ArrivalCheck, segments: list[bytes], order: list[int], rng) -> None:
    """Each layer in `order`, copied into its own buffer in pieces cut at random points."""
    for layer in order:
        segment = memoryview(bytearray(len(segments[layer])))
        cuts = sorted(rng.sample(range(1, len(segment)), 3))
        for start, end in zip([0, *cuts], [*cuts, len(segment)], strict=True):
            segment[start:end] = segments[layer][start:end]
            check.arrived(layer, segment[start:end], segment)


@pytest.mark.parametrize("order", ["in order", "reversed", "shuffled"])
def test_checks_equal_those_of_the_layer_major_bytes_however_layers_arrive(order):
    rng = random.Random(order)
    segments = [os.urandom(4096) for _ in range(6)]
    layers = list(range(6))
    layers = {"in order": layers, "reversed": layers[::-1]}.get(order) or rng.sample(layers, 6)
    check = ArrivalCheck(len(segments), 4096)
    arrive(check, segments, layers, rng)
    assert check.complete
    assert check.digest() == content_digest(segments)
    assert check.crcs == [crc32c(s) for s in segments]
    assert check.crc() == combined_crc(segments)


def test_a_layer_begun_early_is_hashed_whole_once_its_turn_comes():
    """Layer 1's first piece comes before layer 0 is complete: it is not folded then."""
    segments = [os.urandom(64), os.urandom(64)]
    check = ArrivalCheck(2, 64)
    buffers = [memoryview(bytearray(64)) for _ in segments]
    buffers[1][:32] = segments[1][:32]
    check.arrived(1, buffers[1][:32], buffers[1])
    buffers[0][:] = segments[0]
    check.arrived(0, buffers[0], buffers[0])
    assert not check.complete
    buffers[1][32:] = segments[1][32:]
    check.arrived(1, buffers[1][32:], buffers[1])
    assert check.digest() == content_digest(segments)


def test_a_proof_from_the_previous_statement_format_is_replaced_by_a_signed_put(tmp_path):
    signer = Signer.generate()
    shard = Shard(
        ShardConfig(
            shard_id="s",
            memory_bytes=1 << 20,
            disk_bytes=0,
            disk_dir=tmp_path,
            provenance_key=signer.verifier.public_bytes,
        )
    )
    tokens = list(range(16))
    key = chunk_keys(tokens, LAYOUT, SPACE.salt)[0]
    size = LAYOUT.segment_bytes(16)
    old = Blob(
        id=chunk_id(SPACE, key),
        layout=LAYOUT,
        owner="a",
        tokens=tuple(tokens),
        segment_bytes=size,
        crcs=(crc32c(bytes(size)),) * LAYOUT.num_layers,
        data=(bytes(size),) * LAYOUT.num_layers,
        # as a shard before PROOF_FORMAT 2 kept it: signed, over a SHA-256 digest, no format
        meta={
            "parent": parent_keys([key], LAYOUT, SPACE.salt)[0],
            "digest": "00" * 32,
            "signature": "11" * 64,
            "signed": True,
        },
    )
    shard.commit([old], "a", lambda owner: None)
    assert not is_signed(shard.holdings.placement.find(old.id))

    segments = [os.urandom(size) for _ in range(LAYOUT.num_layers)]
    digest = content_digest(segments)
    statement = chunk_statement(LAYOUT, token_digests(tokens, [16])[0], digest)
    session = shard.begin_put(
        SPACE, LAYOUT, tokens, [0], "a", lambda owner: None, [signer.sign(statement)]
    )
    for layer, segment in enumerate(segments):
        session.add(layer, 0, segment)
    session.commit([combined_crc(segments)])
    stored = shard.holdings.placement.find(old.id)
    assert is_signed(stored) and stored.meta["proof"] == PROOF_FORMAT
    assert proof_of(stored).digest == digest
    assert b"".join(bytes(s) for s in stored.data) == b"".join(segments)
