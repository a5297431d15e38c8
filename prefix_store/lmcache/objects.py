"""LMCache objects in the prefix store: opaque bytes under a key string, per namespace.

An object is stored as an artifact (`StoreClient.put_artifact`), so the store's
authentication, namespaces, replication (rendezvous placement over the live shards),
CRC-32C on every read and on the wire, quotas (replicas included) and LRU tiers all apply,
and the shards need nothing new. Its artifact id:

- layout `OBJECT_LAYOUT` (model id "lmcache-object-v1": no model's, so no decoder ever takes
  an object for a prefix's compressed KV; decoders also refuse unsigned artifacts);
- prefix key: SHA-256/CBOR (64 bit) of (version, the namespace's salt, the key string), so
  placement differs per namespace;
- "compressor" spec: "lmcache:" + the key string, so the blob id holds the whole key and two
  keys never share a blob, whatever their 64-bit hashes.

The stored bytes are an envelope (`Envelope`: magic, version, LMCache's format, dtype and
shape codes, the payload length, the key again) followed by the payload, byte for byte.
"""

from __future__ import annotations

import struct

import numpy as np

from prefix_store.client import CachedPrefix, ChunkPlan, StoreClient
from prefix_store.keys import sha256_cbor_64bit
from prefix_store.layout import KVLayout
from prefix_store.lmcache.protocol import ObjectMeta

OBJECT_VERSION = "lmcache-object-v1"
OBJECT_LAYOUT = KVLayout(OBJECT_VERSION, "float32", num_layers=1, num_kv_heads=1, head_dim=1)
SPEC_PREFIX = "lmcache:"


class Envelope:
    """The bytes before an object's payload: `HEAD` then the UTF-8 key."""

    MAGIC = b"VCLM"
    VERSION = 1
    HEAD = struct.Struct("<4sHHii4iQ")
    """magic, version, key bytes, fmt, dtype, shape[4], payload bytes"""

    @classmethod
    def size(cls, key: str) -> int:
        return cls.HEAD.size + len(key.encode())

    @classmethod
    def head(cls, key: str, meta: ObjectMeta, length: int) -> bytearray:
        """The envelope of an object of `length` payload bytes; the payload is appended to
        it as it arrives."""
        raw_key = key.encode()
        return bytearray(
            cls.HEAD.pack(
                cls.MAGIC, cls.VERSION, len(raw_key), meta.fmt, meta.dtype, *meta.shape, length
            )
            + raw_key
        )

    @classmethod
    def buffer(cls, key: str, meta: ObjectMeta, length: int) -> tuple[memoryview, memoryview]:
        """The whole stored object's final buffer, its envelope written; and the view of it
        the payload is read into (`length` bytes, not written yet: the allocator maps it
        without touching it, so its pages, 4 KiB or 2 MiB huge ones, are backed only as its
        bytes land, and memory grows with what arrived, not with `length`)."""
        head = cls.head(key, meta, length)
        buffer = memoryview(np.empty(len(head) + length, dtype=np.uint8))
        buffer[: len(head)] = head
        return buffer, buffer[len(head) :]

    @classmethod
    def open(cls, key: str, data: bytes) -> tuple[ObjectMeta, memoryview] | None:
        """The meta and payload of a stored object; None unless it is whole and `key`'s."""
        if len(data) < cls.HEAD.size:
            return None
        magic, version, key_bytes, fmt, dtype, *rest = cls.HEAD.unpack_from(data)
        shape, length = tuple(rest[:4]), rest[4]
        start = cls.HEAD.size + key_bytes
        if magic != cls.MAGIC or version != cls.VERSION or len(data) != start + length:
            return None
        if bytes(data[cls.HEAD.size : start]) != key.encode():
            return None
        return ObjectMeta(fmt, dtype, shape), memoryview(data)[start:]


class ObjectStore:
    """LMCache's key -> object map of one namespace, over a store client (thread-safe as
    the client is). Store failures raise the client's typed errors (`StoreError`)."""

    def __init__(self, client: StoreClient, namespace: str = "") -> None:
        self.client = client
        self.namespace = namespace
        self.salt = client.topology.salt(namespace)

    def put(self, key: str, stored) -> int:
        """Store an object (its envelope and payload, from `Envelope.buffer`: a buffer the
        data plane sends from as it is, or an `Arriving` one still being filled), replacing
        one under the same key; returns the bytes stored (replicas included). Refused whole
        (QuotaExceeded, StoreFull, ...) before the old object is touched: over the data
        plane, by every owner before any byte moves (`StoreClient.put_artifact`)."""
        return self.client.put_artifact(self._prefix(key), SPEC_PREFIX + key, stored)

    def get(self, key: str) -> tuple[ObjectMeta, memoryview] | None:
        """The object's meta and payload; None on a miss (absent, evicted, corrupt on every
        replica, or not a whole object of this key)."""
        data = self.client.fetch_artifact(self._prefix(key), SPEC_PREFIX + key)
        return None if data is None else Envelope.open(key, data)

    def exists(self, key: str) -> bool:
        return self.client.has_artifact(self._prefix(key), SPEC_PREFIX + key)

    def _prefix(self, key: str) -> CachedPrefix:
        """The artifact's "prefix": one token, keyed by the key string's salted hash."""
        object_key = sha256_cbor_64bit((OBJECT_VERSION, self.salt, key))
        chunk = ChunkPlan(0, object_key, object_key, 0, 1)
        return CachedPrefix(self.namespace, OBJECT_LAYOUT, 1, (chunk,))
