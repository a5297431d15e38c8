"""The shard's names for what it stores: blob ids of chunks and artifacts, their tokens
and their provenance."""

from __future__ import annotations

from prefix_store.blob import Blob, BlobId
from prefix_store.layout import KVLayout
from prefix_store.namespace import Namespace
from prefix_store.provenance import PROOF_FORMAT, Proof


def chunk_id(namespace: Namespace, key: int) -> BlobId:
    return ("chunk", namespace.id, key)


def artifact_id(namespace: Namespace, layout: KVLayout, prefix_key: int, spec: str) -> BlobId:
    return ("artifact", namespace.id, prefix_key, spec, layout.identity())


def chunk_tokens(ids: list[int], layout: KVLayout, index: int) -> list[int]:
    """The token ids of chunk `index` (the last chunk may be partial)."""
    start = index * layout.chunk_tokens
    return ids[start : start + layout.chunk_tokens]


def is_partial(blob: Blob) -> bool:
    """Whether the blob is a chunk of fewer tokens than a full one."""
    return blob.kind == "chunk" and len(blob.tokens) < blob.layout.chunk_tokens


def proof_of(blob: Blob) -> Proof:
    """A stored blob's provenance (see `prefix_store.provenance`)."""
    meta = blob.meta
    return Proof(bytes.fromhex(meta.get("digest", "")), bytes.fromhex(meta.get("signature", "")))


def is_signed(blob: Blob) -> bool:
    """Whether the shard checked the blob's signature with the deployment's key, under the
    current statements (`PROOF_FORMAT`): a blob kept from an older format is unsigned, so
    a signed put replaces it."""
    return bool(blob.meta.get("signed")) and blob.meta.get("proof") == PROOF_FORMAT
