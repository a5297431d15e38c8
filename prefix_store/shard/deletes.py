"""Deletes: what a tenant may remove from a shard, by token sequence or by the keys of its
own put (undoing it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefix_store.blob import Blob
from prefix_store.config import ShardConfig
from prefix_store.keys import chunk_keys
from prefix_store.layout import KVLayout
from prefix_store.namespace import Namespace
from prefix_store.protocol.tokens import validate_tokens
from prefix_store.shard.blobs import chunk_id
from prefix_store.shard.holdings import Holdings


@dataclass(frozen=True, slots=True)
class Deletable:
    """Whose blobs a delete may remove: its caller's own, or all when it owns the namespace."""

    caller: str
    everything: bool = False

    def __call__(self, blob: Blob) -> bool:
        return self.everything or blob.owner == self.caller


ANYONE = Deletable("", everything=True)


def delete(
    config: ShardConfig,
    holdings: Holdings,
    namespace: Namespace,
    layout: KVLayout,
    token_ids: Sequence[int],
    may: Deletable = ANYONE,
) -> tuple[int, int, int]:
    """As `Shard.delete`."""
    ids = validate_tokens(token_ids, limit=config.max_tokens)
    keys = set(chunk_keys(ids, layout, namespace.salt))
    chunks = artifacts = nbytes = 0
    with holdings.mutating():
        for blob_id in holdings.placement.ids():
            blob = holdings.placement.find(blob_id)
            if blob is None or blob.namespace != namespace.id or blob.id[2] not in keys:
                continue
            if blob.layout != layout or not may(blob):
                continue
            holdings.drop(blob_id)
            chunks += blob.kind == "chunk"
            artifacts += blob.kind == "artifact"
            nbytes += blob.nbytes
    return chunks, artifacts, nbytes


def delete_keys(
    holdings: Holdings, namespace: Namespace, keys: Sequence[int], may: Deletable = ANYONE
) -> tuple[int, int, int]:
    """As `Shard.delete_keys`."""
    chunks = nbytes = 0
    with holdings.mutating():
        for key in set(keys):
            blob_id = chunk_id(namespace, key)
            blob = holdings.placement.find(blob_id)
            if blob is None:
                continue
            if holdings.claims.unclaim(blob_id, may.caller) > 0 or not may(blob):
                continue
            holdings.drop(blob_id)
            chunks, nbytes = chunks + 1, nbytes + blob.nbytes
    return chunks, 0, nbytes
