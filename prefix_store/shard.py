"""A shard: the chunks and artifacts placed on it, in a memory tier spilling to disk.

Thread-safe: index changes happen under one lock; bytes are copied out of leased blobs
without it, and disk writes and removals happen after the change that staged them, also
without it (`Shard._mutating`). Every read checks the blob's CRC-32C; a blob that fails is
dropped and the read fails with `DataLoss` (a later lookup reports a miss). Nothing here
knows about tenants' tokens or gRPC: callers pass resolved namespaces and owners.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefix_store.blob import Blob, BlobId, combined_crc, crc32c
from prefix_store.config import ShardConfig
from prefix_store.data_plane import head_major
from prefix_store.errors import (
    Aborted,
    DataLoss,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    QuotaExceeded,
    StoreFull,
    Unavailable,
)
from prefix_store.keys import chunk_keys, parent_keys
from prefix_store.layout import KVLayout
from prefix_store.namespace import Namespace
from prefix_store.protocol.tokens import validate_tokens
from prefix_store.provenance import (
    Proof,
    Verifier,
    artifact_statement,
    chunk_statement,
    content_digest,
    token_digests,
)
from prefix_store.shares import FairShare
from prefix_store.tiers import DiskTier, MemoryTier
from prefix_store.tiers.disk import DiskIO, Write

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Allowance:
    """What the metadata plane says about an owner: its quota and its bytes elsewhere."""

    quota: int
    elsewhere: int
    """Bytes the owner stores on the other live shards."""


# quota(owner) -> the owner's Allowance, or None when unlimited. It may do network I/O,
# so the shard calls it before taking its lock and checks its own usage under the lock.
QuotaCheck = Callable[[str], Allowance | None]
ACCOUNTING_SLICE = 4096


def chunk_id(namespace: Namespace, key: int) -> BlobId:
    return ("chunk", namespace.id, key)


def artifact_id(namespace: Namespace, layout: KVLayout, prefix_key: int, spec: str) -> BlobId:
    return ("artifact", namespace.id, prefix_key, spec, layout.identity())


def proof_of(blob: Blob) -> Proof:
    """A stored blob's provenance (see `prefix_store.provenance`)."""
    meta = blob.meta
    return Proof(bytes.fromhex(meta.get("digest", "")), bytes.fromhex(meta.get("signature", "")))


def is_signed(blob: Blob) -> bool:
    """Whether the shard checked the blob's signature with the deployment's key."""
    return bool(blob.meta.get("signed"))


@dataclass(frozen=True, slots=True)
class LookupResult:
    keys: list[int]
    """Keys of every chunk of the looked-up tokens (the last may be partial)."""
    present: list[int]
    """Requested chunk indices held here as full chunks, confirmed by their tokens."""
    partial_index: int = 0
    partial_tokens: int = 0
    partial_key: int = 0
    cached_tokens: int = 0
    proofs: list[Proof] = field(default_factory=list)
    """One per `present` entry."""
    partial_proof: Proof = Proof()


@dataclass(frozen=True, slots=True)
class Deletable:
    """Whose blobs a delete may remove: its caller's own, or all when it owns the namespace."""

    caller: str
    everything: bool = False

    def __call__(self, blob: Blob) -> bool:
        return self.everything or blob.owner == self.caller


ANYONE = Deletable("", everything=True)


@dataclass(slots=True)
class Reservation:
    """What a put holds while its bytes arrive (see `Shard.reserve`): `new` bytes of its
    owner's quota from its header, and of the shard's receive budget only the bytes that
    arrived (`grow`). `release` once."""

    shard: Shard
    owner: str
    declared: int
    new: int
    weight: float | None = None
    """The owner's weight in the shares (None: `Shard.receiving` reads it)."""
    staged: int = 0
    """Bytes received so far, held in the owner's share of `Shard.receiving`."""
    released: bool = False

    def grow(self, nbytes: int) -> None:
        """Hold `nbytes` more that are about to be buffered (LimitExceeded over the owner's
        share of the receive budget)."""
        if self.released:
            raise Aborted("put: it already ended; nothing was stored")
        if self.staged + nbytes > self.declared:
            raise InvalidArgument(f"put: more than the {self.declared} bytes its header declared")
        self.shard.receiving.acquire(self.owner, nbytes, self.weight)
        self.staged += nbytes

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.shard._unreserve(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass(frozen=True, slots=True)
class ChunkRef:
    key: int
    tokens: int
    digest: bytes = b""
    """When set, only a chunk whose stored bytes have this SHA-256 may be served."""


@dataclass(frozen=True, slots=True)
class Committed:
    keys: list[int]
    """Every key of the put (chunks that were already stored included)."""
    new_bytes: int
    new_keys: list[int]
    """Keys this put stored: what undoing it must delete."""


@dataclass
class ShardStats:
    hits: int = 0
    misses: int = 0
    fetched_bytes: int = 0
    received_bytes: int = 0
    """Bytes of committed puts (chunks and artifacts), already held ones included."""
    stored_bytes: int = 0
    """Of which new to this shard."""
    evictions: int = 0
    corrupt: int = 0
    scrubbed_bytes: int = 0
    """Bytes at rest the scrubber re-checked (`prefix_store.scrub`)."""
    scrub_corrupt: int = 0
    """Of `corrupt`, blobs the scrubber found (dropped before any read met them)."""
    lost_spills: int = 0
    """Blobs evicted from memory whose disk write failed (dropped, like an eviction)."""
    usage: Counter = field(default_factory=Counter)


def _chunk_tokens(ids: list[int], layout: KVLayout, index: int) -> list[int]:
    start = index * layout.chunk_tokens
    return ids[start : start + layout.chunk_tokens]


class Shard:
    def __init__(
        self, config: ShardConfig, weight: Callable[[str], float] = lambda tenant: 1.0
    ) -> None:
        """`weight(tenant)`: the tenant's weight in the shares of the receive budget."""
        self.config = config
        self.verifier = Verifier(config.provenance_key) if config.provenance_key else None
        self._lock = threading.RLock()
        self._leases: Counter = Counter()
        self._doomed: set[BlobId] = set()
        # Per blob, the owners whose puts committed it since this process started, and how
        # many times each (see delete_keys).
        self._claims: dict[BlobId, Counter] = {}
        # Bytes of puts that arrived and are buffered, in tenants' fair shares; and the new
        # bytes puts being received declared, per owner, held against its quota (reserve).
        self.receiving = FairShare(config.receive_bytes, "bytes of puts being received", weight)
        self._receiving_new: Counter = Counter()
        self.memory = MemoryTier(config.memory_bytes, self._is_leased)
        disk_dir = Path(config.disk_dir) if config.disk_dir else Path("/nonexistent")
        self.disk = DiskTier(disk_dir, config.disk_bytes, self._is_leased)
        self.stats = ShardStats()
        self._partials: defaultdict[tuple[str, int], set[int]] = defaultdict(set)
        self._depth = 0  # nesting of _mutating in the thread that holds the lock
        for blob_id in self.disk.ids():
            self._admitted(self.disk.get(blob_id))

    # ---- changes and their disk I/O ----------------------------------------------------

    @contextmanager
    def _mutating(self) -> Iterator[list[Write]]:
        """The shard's lock, for a change of what it holds. The disk writes and removals
        the change staged are done when the outermost such block ends, after the lock is
        released, by this thread before it goes on. Yields a list that then holds the
        writes that failed (their blobs forgotten, their usage released)."""
        failed: list[Write] = []
        with self._lock:
            self._depth += 1
            try:
                yield failed
            finally:
                self._depth -= 1
                io = self.disk.take_io() if self._depth == 0 else DiskIO()
        failed.extend(self._do_disk_io(io))

    def _do_disk_io(self, io: DiskIO) -> list[Write]:
        failed = []
        while io:
            self.disk.perform(io)
            with self._lock:
                for write in io.writes:
                    if self.disk.settle(write):
                        failed.append(write)
                        if write.blob.id not in self.memory:
                            self._gone(write.blob)
                io = self.disk.take_io()
        return failed

    def _settle_change(self, failed: list[Write], new: list[Blob]) -> None:
        """After a change: blobs it evicted whose disk write failed are lost like any
        evicted blob (counted); if a blob it stored itself could not be written, the change
        is undone as a whole (its other new blobs dropped unless another put claims them)
        and fails: StoreFull when the disk is full, else Unavailable."""
        if not failed:
            return  # the common case: no second trip through the lock
        new_ids = {b.id for b in new}
        own = [w for w in failed if w.blob.id in new_ids]
        with self._mutating():
            self.stats.lost_spills += len(failed) - len(own)
            if not own:
                return
            lost_ids = {w.blob.id for w in own}
            for blob in new:
                claimed = self._unclaim(blob.id, blob.owner) > 0
                if not claimed and blob.id not in lost_ids and self._find(blob.id) is not None:
                    self._drop(blob.id)
        error = own[0].error  # its message names no path: callers are tenants
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFull(f"shard {self.config.shard_id}: the disk tier is full")
        raise Unavailable(
            f"shard {self.config.shard_id}: writing to the disk tier failed "
            f"({error.strerror or type(error).__name__}); nothing was stored, retry"
        )

    # ---- bookkeeping -------------------------------------------------------------------

    def _is_leased(self, blob_id: BlobId) -> bool:
        return self._leases[blob_id] > 0

    def _unclaim(self, blob_id: BlobId, owner: str) -> int:
        """Take one of `owner`'s claims on a blob (if it has one); the claims left."""
        claims = self._claims.get(blob_id)
        if claims is None:
            return 0
        if claims[owner] > 0:
            claims[owner] -= 1
            if claims[owner] <= 0:
                del claims[owner]
        if not claims:
            del self._claims[blob_id]
        return sum(claims.values())

    def _find_live(self, blob_id: BlobId) -> Blob | None:
        """A blob readers may use: not one waiting for its leases to end before removal."""
        return None if blob_id in self._doomed else self._find(blob_id)

    def _check_quota(self, owner: str, allowance: Allowance | None, new_bytes: int) -> None:
        if allowance is None or new_bytes == 0:
            return
        used = allowance.elsewhere + self.stats.usage.get(owner, 0)
        if used + new_bytes > allowance.quota:
            raise QuotaExceeded(
                f"tenant {owner!r}: {used} bytes stored + {new_bytes} new bytes exceed "
                f"its quota of {allowance.quota} bytes"
            )

    def _find(self, blob_id: BlobId) -> Blob | None:
        """The blob, its recency unchanged (bookkeeping: only reads count as use)."""
        return self.memory.peek(blob_id) or self.disk.peek(blob_id)

    def _touch(self, blob_id: BlobId) -> Blob | None:
        """The blob, now the most recently used in its tier (a read)."""
        return self.memory.get(blob_id) or self.disk.get(blob_id)

    def _read_live(self, blob_id: BlobId) -> Blob | None:
        """As `_find_live`, for a read: the blob becomes the most recently used."""
        return None if blob_id in self._doomed else self._touch(blob_id)

    def _admitted(self, blob: Blob) -> None:
        self.stats.usage[blob.owner] += blob.nbytes
        if blob.kind == "chunk" and len(blob.tokens) < blob.layout.chunk_tokens:
            self._partials[(blob.namespace, blob.meta["parent"])].add(blob.id[2])

    def _gone(self, blob: Blob) -> None:
        self._claims.pop(blob.id, None)
        self.stats.usage[blob.owner] -= blob.nbytes
        if self.stats.usage[blob.owner] <= 0:
            del self.stats.usage[blob.owner]
        if blob.kind == "chunk" and len(blob.tokens) < blob.layout.chunk_tokens:
            where = (blob.namespace, blob.meta["parent"])
            keys = self._partials.get(where)
            if keys is not None:
                keys.discard(blob.id[2])
                if not keys:
                    del self._partials[where]

    def _drop(self, blob_id: BlobId) -> Blob | None:
        """Remove a blob from both tiers (deferred while leased)."""
        if self._is_leased(blob_id):
            self._doomed.add(blob_id)
            return self._find(blob_id)
        in_memory = self.memory.remove(blob_id)
        on_disk = self.disk.remove(blob_id)
        blob = in_memory or on_disk
        if blob is not None:
            self._gone(blob)
        return blob

    def _spill(self, victims: list[Blob]) -> None:
        """Move blobs evicted from memory to disk; drop them if disk has no room."""
        for blob in victims:
            self.stats.evictions += 1
            if blob.id in self.disk:
                continue
            if self.disk.capacity and self.disk.fits(blob.nbytes):
                self._disk_room(blob.nbytes)
                self.disk.write(blob)
            else:
                self._gone(blob)

    def _disk_room(self, nbytes: int) -> None:
        for dropped in self.disk.make_room(nbytes):
            if dropped.id not in self.memory:
                self._gone(dropped)

    def _place(self, blob: Blob) -> None:
        """Store a new blob: memory if it fits (spilling LRU blobs), else disk."""
        if self.memory.fits(blob.nbytes):
            self._spill(self.memory.make_room(blob.nbytes))
            self.memory.insert(blob)
        elif self.disk.capacity and self.disk.fits(blob.nbytes):
            self._disk_room(blob.nbytes)
            self.disk.write(blob)
        else:
            raise StoreFull(f"shard {self.config.shard_id}: no room for {blob.nbytes} bytes")
        self._admitted(blob)

    def _room_for(self, nbytes: int) -> bool:
        return self.memory.fits(nbytes) or bool(self.disk.capacity and self.disk.fits(nbytes))

    # ---- lookup ------------------------------------------------------------------------

    def lookup(
        self,
        namespace: Namespace,
        layout: KVLayout,
        token_ids: Sequence[int],
        indices: Sequence[int] = (),
    ) -> LookupResult:
        """Which of the requested chunks of `token_ids` are held here; for the first one
        that is not, the longest stored partial chunk that starts it."""
        self.config.layouts.check(layout)
        ids = validate_tokens(token_ids, limit=self.config.max_tokens)
        keys = chunk_keys(ids, layout, namespace.salt)
        if len(indices) > len(keys):
            raise InvalidArgument(f"chunk_indices: more than the {len(keys)} chunks")
        parents = parent_keys(keys, layout, namespace.salt)
        wanted = sorted(set(indices)) if indices else list(range(len(keys)))
        if wanted and (wanted[0] < 0 or wanted[-1] >= len(keys)):
            raise InvalidArgument(f"chunk_indices: must be in [0, {len(keys)})")
        present, proofs, partial, partial_proof = [], [], (0, 0, 0), Proof()
        with self._lock:
            for index in wanted:
                blob = self._held_full(namespace, layout, ids, keys, index)
                if blob is not None:
                    present.append(index)
                    proofs.append(proof_of(blob))
                    continue
                partial = self._longest_partial(namespace, layout, ids, parents, index)
                if partial[1]:
                    partial_proof = proof_of(self._read_live(chunk_id(namespace, partial[2])))
                break
            self.stats.hits += len(present)
            self.stats.misses += len(wanted) - len(present)
        leading = 0
        if not indices:
            leading = len(present) * layout.chunk_tokens if present == wanted[: len(present)] else 0
            leading += partial[1]
        return LookupResult(keys, present, *partial, leading, proofs, partial_proof)

    def _held_full(self, namespace, layout, ids, keys, index) -> Blob | None:
        tokens = _chunk_tokens(ids, layout, index)
        if len(tokens) < layout.chunk_tokens:
            return None
        blob = self._find_live(chunk_id(namespace, keys[index]))
        if not self._matches(blob, layout, tokens):
            return None
        return self._read_live(blob.id)

    @staticmethod
    def _matches(blob: Blob | None, layout: KVLayout, tokens: list[int]) -> bool:
        return blob is not None and blob.layout == layout and list(blob.tokens) == tokens

    def _longest_partial(self, namespace, layout, ids, parents, index) -> tuple[int, int, int]:
        want = _chunk_tokens(ids, layout, index)
        best = (index, 0, 0)
        for key in self._partials.get((namespace.id, parents[index]), ()):
            blob = self._find_live(chunk_id(namespace, key))
            n = len(blob.tokens) if blob is not None else 0
            if n > best[1] and self._matches(blob, layout, want[:n]) and n <= len(want):
                best = (index, n, key)
        return best

    # ---- put ---------------------------------------------------------------------------

    def begin_put(
        self,
        namespace: Namespace,
        layout: KVLayout,
        token_ids: Sequence[int],
        indices: Sequence[int],
        owner: str,
        quota: QuotaCheck,
        signatures: Sequence[bytes] = (),
        weight: float | None = None,
    ) -> PutSession:
        """A put of chunks `indices` of `token_ids`, checked and admitted (`reserve`;
        `weight`: the owner's in the shares of the receive budget)."""
        self.config.layouts.check(layout, "header.layout")
        ids = validate_tokens(token_ids, "header.token_ids", self.config.max_tokens)
        return PutSession(self, namespace, layout, ids, indices, owner, quota, signatures, weight)

    def check_signature(self, statement: bytes, signature: bytes, what: str) -> bool:
        """Whether a put's signature was checked (True) or there was none / no key to
        check it with (False); a signature that fails the check refuses the put."""
        if not signature or self.verifier is None:
            return False
        if not self.verifier.verify(statement, signature):
            raise InvalidArgument(f"{what}: the signature does not verify for these bytes")
        return True

    def commit(self, blobs: list[Blob], owner: str, quota: QuotaCheck) -> Committed:
        """Make complete, checked blobs visible, all or none. A signed blob replaces an
        unsigned one of the same key (an unreferenced one: a leased one is UNAVAILABLE)."""
        allowance = quota(owner)
        with self._mutating() as failed:
            self._refuse_doomed(blobs)
            stale = [self._find(b.id) for b in blobs if self._replaces(b)]
            self._refuse_leased([old.id for old in stale])
            replaced = {old.id for old in stale}
            new = [b for b in blobs if b.id in replaced or self._find(b.id) is None]
            new_bytes = sum(b.nbytes for b in new)
            freed = sum(old.nbytes for old in stale)
            own_freed = sum(old.nbytes for old in stale if old.owner == owner)
            self._check_quota(owner, allowance, max(0, new_bytes - own_freed))
            if not self._room_for(max(0, new_bytes - freed)):
                raise StoreFull(
                    f"shard {self.config.shard_id}: no room for {new_bytes} bytes "
                    f"(memory {self.memory.used}/{self.memory.capacity}, "
                    f"disk {self.disk.used}/{self.disk.capacity})"
                )
            for old in stale:
                self._drop(old.id)
            for blob in new:
                self._place(blob)
            for blob in blobs:
                self._claims.setdefault(blob.id, Counter())[owner] += 1
            self.stats.received_bytes += sum(b.nbytes for b in blobs)
            self.stats.stored_bytes += new_bytes
        self._settle_change(failed, new)
        return Committed([b.id[2] for b in blobs], new_bytes, [b.id[2] for b in new])

    def _replaces(self, blob: Blob) -> bool:
        old = self._find(blob.id)
        return old is not None and is_signed(blob) and not is_signed(old)

    def _refuse_leased(self, blob_ids: list[BlobId]) -> None:
        for blob_id in blob_ids:
            if self._is_leased(blob_id):
                raise Unavailable(
                    f"{blob_id[0]} {blob_id[2]:016x} is being read; retry the signed put shortly"
                )

    def _refuse_doomed(self, blobs: list[Blob]) -> None:
        for blob in blobs:
            if blob.id in self._doomed:
                raise Unavailable(
                    f"{blob.kind} {blob.id[2]:016x} is being removed (reads still hold it); "
                    "retry shortly"
                )

    def new_bytes(self, namespace: Namespace, keys: Sequence[int], sizes: Sequence[int]) -> int:
        """Bytes a put of these chunks would add (chunks already stored cost nothing)."""
        with self._lock:
            return sum(
                size
                for key, size in zip(keys, sizes, strict=True)
                if self._find_live(chunk_id(namespace, key)) is None
            )

    # ---- fetch -------------------------------------------------------------------------

    def open_fetch(
        self,
        namespace: Namespace,
        layout: KVLayout,
        refs: Sequence[ChunkRef],
        layer_start: int,
        layer_end: int,
    ) -> FetchStream:
        """Check the request and lease its chunks now; the stream reads them later."""
        if not 0 <= layer_start < layer_end <= layout.num_layers:
            raise InvalidArgument(
                f"layer range: [{layer_start}, {layer_end}) is not within [0, {layout.num_layers}]"
            )
        blobs = self._lease_chunks(namespace, layout, refs)
        return FetchStream(self, blobs, layer_start, layer_end)

    def fetch(
        self,
        namespace: Namespace,
        layout: KVLayout,
        refs: Sequence[ChunkRef],
        layer_start: int,
        layer_end: int,
        message_bytes: int,
    ) -> Iterator[list[tuple[int, int, bytes, int]]]:
        """Batches of (layer, chunk index, K+V bytes, their stored CRC-32C): every chunk of a
        layer before the next layer, batches of about `message_bytes`. The chunks are
        leased until it ends."""
        stream = self.open_fetch(namespace, layout, refs, layer_start, layer_end)
        try:
            batch, size = [], 0
            for segment in stream.segments():
                batch.append(segment)
                size += len(segment[2])
                if size >= message_bytes:
                    yield batch
                    batch, size = [], 0
            if batch:
                yield batch
        finally:
            stream.close()

    def _lease_chunks(self, namespace, layout, refs) -> list[Blob]:
        with self._lock:
            blobs = []
            for index, ref in enumerate(refs):
                blob = self._read_live(chunk_id(namespace, ref.key))
                if blob is None or blob.layout != layout or len(blob.tokens) != ref.tokens:
                    raise NotFound(f"chunks[{index}]: chunk {ref.key:016x} is not stored here")
                if ref.digest and proof_of(blob).digest != ref.digest:
                    raise NotFound(
                        f"chunks[{index}]: chunk {ref.key:016x} is stored here with other bytes "
                        "than the digest asked for"
                    )
                blobs.append(blob)
            for blob in blobs:
                self._leases[blob.id] += 1
            return blobs

    def _release(self, blob_ids: list[BlobId]) -> None:
        with self._mutating():
            for blob_id in blob_ids:
                self._leases[blob_id] -= 1
                if self._leases[blob_id] <= 0:
                    del self._leases[blob_id]
                    if blob_id in self._doomed:
                        self._doomed.discard(blob_id)
                        self._drop(blob_id)

    def _read_segment(self, blob: Blob, index: int) -> bytes:
        if blob.data is not None:
            data = blob.segment(index)
        else:
            try:
                data = self.disk.read_segment(blob.id, index)
            except (OSError, KeyError) as error:
                self._corrupt(blob, f"segment {index} unreadable: {error}")
        if crc32c(data) != blob.crcs[index]:
            self._corrupt(blob, f"segment {index}")
        return data

    def _corrupt(self, blob: Blob, where: str) -> None:
        log.error(
            "shard %s: blob %s failed its checksum at %s; dropped",
            self.config.shard_id,
            blob.id[:3],
            where,
        )
        with self._mutating():
            self.stats.corrupt += 1
            self._doomed.add(blob.id)
            if not self._is_leased(blob.id):
                self._doomed.discard(blob.id)
                self._drop(blob.id)
        raise DataLoss(
            f"chunk {blob.id[2]:016x}: stored bytes failed their checksum ({where}); "
            "dropped, read it from a replica"
        )

    # ---- scrubbing ---------------------------------------------------------------------

    def scrub_ids(self) -> list[BlobId]:
        """Every blob held now, for a scrub pass (`prefix_store.scrub`)."""
        with self._lock:
            return list(dict.fromkeys(self.memory.ids() + self.disk.ids()))

    def scrub(self, blob_id: BlobId) -> int:
        """Re-check a blob at rest: every segment against its stored CRC-32C, from the tier
        that holds it, without a lease (readers, puts and eviction never wait for it) and
        its recency unchanged. A blob that fails and is still the one read (not replaced
        or removed meanwhile) is dropped as a corrupt read drops it (counted in
        `stats.corrupt` and `stats.scrub_corrupt`), never served again. Returns the bytes
        checked (0: the blob is gone)."""
        with self._lock:
            blob = self._find_live(blob_id)
        if blob is None:
            return 0
        for index in range(len(blob.crcs)):
            fault = self._check_at_rest(blob, index)
            if fault is not None:
                with self._lock:
                    if self._find(blob_id) is not blob:
                        return 0  # replaced or removed while it was read: not a fault
                    self.stats.scrub_corrupt += 1
                with contextlib.suppress(DataLoss):
                    self._corrupt(blob, fault)
                break
        with self._lock:
            self.stats.scrubbed_bytes += blob.nbytes
        return blob.nbytes

    def _check_at_rest(self, blob: Blob, index: int) -> str | None:
        """What is wrong with one stored segment (unreadable, checksum), or None."""
        try:
            if blob.data is not None:
                data = blob.segment(index)
            else:
                data = self.disk.read_segment(blob.id, index)
        except (OSError, KeyError) as error:
            return f"segment {index} unreadable at rest: {error}"
        return None if crc32c(data) == blob.crcs[index] else f"segment {index} (at rest)"

    # ---- artifacts ---------------------------------------------------------------------

    def put_artifact(
        self,
        namespace: Namespace,
        layout: KVLayout,
        prefix_key: int,
        prefix_tokens: int,
        spec: str,
        data: bytes,
        owner: str,
        quota: QuotaCheck,
        signature: bytes = b"",
    ) -> int:
        """Store (or replace) an artifact; a signed one is never replaced by an unsigned one."""
        digest = content_digest([data])
        statement = artifact_statement(layout, prefix_key, prefix_tokens, spec, digest)
        signed = self.check_signature(statement, signature, "id.signature")
        blob = Blob(
            id=artifact_id(namespace, layout, prefix_key, spec),
            layout=layout,
            owner=owner,
            tokens=(prefix_tokens,),
            segment_bytes=len(data),
            crcs=(crc32c(data),),
            data=(data,),
            meta={"digest": digest.hex(), "signature": signature.hex(), "signed": signed},
        )
        allowance = quota(owner)
        with self._mutating() as failed:
            self._refuse_doomed([blob])
            old = self._find(blob.id)
            if old is not None and is_signed(old) and not signed:
                raise InvalidArgument(
                    f"artifact {spec!r} of prefix {prefix_key:016x}: a signed artifact is "
                    "stored; an unsigned one cannot replace it"
                )
            if old is not None:
                self._refuse_leased([blob.id])
            replaced = old.nbytes if old is not None and old.owner == owner else 0
            self._check_quota(owner, allowance, max(0, blob.nbytes - replaced))
            if not self._room_for(blob.nbytes - (old.nbytes if old is not None else 0)):
                raise StoreFull(f"shard {self.config.shard_id}: no room for {blob.nbytes} bytes")
            if old is not None:
                self._drop(blob.id)
            self._place(blob)
            self.stats.received_bytes += blob.nbytes
            self.stats.stored_bytes += blob.nbytes
        self._settle_change(failed, [blob])
        return blob.nbytes

    def fetch_artifact(
        self, namespace: Namespace, layout: KVLayout, prefix_key: int, spec: str
    ) -> tuple[bytes, int, Proof]:
        """The artifact's bytes, its prefix length and its provenance."""
        blob_id = artifact_id(namespace, layout, prefix_key, spec)
        with self._lock:
            blob = self._read_live(blob_id)
            if blob is None:
                raise NotFound(f"artifact {spec!r} of prefix {prefix_key:016x} is not stored here")
            self._leases[blob_id] += 1
        try:
            return self._read_segment(blob, 0), blob.tokens[0], proof_of(blob)
        finally:
            self._release([blob_id])

    # ---- delete, stats, shutdown ------------------------------------------------------

    def reserve(
        self,
        owner: str,
        allowance: Allowance | None,
        declared: int,
        new: int,
        room: bool = False,
        weight: float | None = None,
    ) -> Reservation:
        """Admit a put declaring `declared` bytes, `new` of them new to the shard: refused
        now what cannot fit (new bytes over the owner's quota, counting the puts it has
        arriving: QuotaExceeded; `room`: no room in the tiers: StoreFull; declared bytes over
        the owner's share of the receive budget now: LimitExceeded). Holds `new` bytes of the
        owner's quota from now, so that concurrent puts cannot together pass checks each
        passes alone, but none of the receive budget: `Reservation.grow` takes that as the
        bytes arrive (`weight`: the owner's in the shares). Released by the put's commit or
        end."""
        with self._lock:
            self._check_quota(owner, allowance, self._receiving_new[owner] + new)
            if room and not self._room_for(new):
                raise StoreFull(f"shard {self.config.shard_id}: no room for {new} bytes")
            share = self.receiving.share(owner, weight)
            if declared > share:
                raise LimitExceeded(
                    f"tenant {owner!r}: a put of {declared} bytes exceeds its fair share of "
                    f"{int(share)} of the {self.config.receive_bytes} bytes of puts this shard "
                    "receives at once (receive_bytes); retry later or put fewer chunks at once"
                )
            self._receiving_new[owner] += new
        return Reservation(self, owner, declared, new, weight)

    def received(self, owner: str | None = None) -> int:
        """Bytes of puts arriving that are buffered now (`owner`'s, or everyone's)."""
        return self.receiving.held(owner)

    def _unreserve(self, reservation: Reservation) -> None:
        self.receiving.release(reservation.owner, reservation.staged)
        with self._lock:
            self._receiving_new[reservation.owner] -= reservation.new
            if self._receiving_new[reservation.owner] <= 0:
                del self._receiving_new[reservation.owner]

    def delete(
        self,
        namespace: Namespace,
        layout: KVLayout,
        token_ids: Sequence[int],
        may: Deletable = ANYONE,
    ):
        """Drop every chunk of `token_ids` held here and the artifacts of those prefixes,
        those that `may` allows. Returns (chunks, artifacts, bytes)."""
        ids = validate_tokens(token_ids, limit=self.config.max_tokens)
        keys = set(chunk_keys(ids, layout, namespace.salt))
        chunks = artifacts = nbytes = 0
        with self._mutating():
            for blob_id in self.memory.ids() + self.disk.ids():
                blob = self._find(blob_id)
                if blob is None or blob.namespace != namespace.id or blob.id[2] not in keys:
                    continue
                if blob.layout != layout or not may(blob):
                    continue
                self._drop(blob_id)
                chunks += blob.kind == "chunk"
                artifacts += blob.kind == "artifact"
                nbytes += blob.nbytes
        return chunks, artifacts, nbytes

    def delete_keys(self, namespace: Namespace, keys: Sequence[int], may: Deletable = ANYONE):
        """Undo the caller's put of these chunks: each loses one claim of the caller's own
        (`may.caller`; another tenant's claims are never touched) and is dropped only when
        no put claims it any more (a concurrent publish that found it present keeps it),
        and when `may` allows. Keys of absent chunks change nothing (no state is kept for
        them). Returns (chunks dropped, 0, bytes)."""
        chunks = nbytes = 0
        with self._mutating():
            for key in set(keys):
                blob_id = chunk_id(namespace, key)
                blob = self._find(blob_id)
                if blob is None:
                    continue
                if self._unclaim(blob_id, may.caller) > 0 or not may(blob):
                    continue
                self._drop(blob_id)
                chunks, nbytes = chunks + 1, nbytes + blob.nbytes
        return chunks, 0, nbytes

    def usage(self) -> dict[str, int]:
        with self._lock:
            return dict(self.stats.usage)

    def accounting(self) -> tuple[int, int]:
        """(bytes of the distinct blobs held, bytes charged to their owners): equal unless
        the accounting is wrong (checked after faults by `make chaos`, on a quiet shard).
        Summed in slices of ACCOUNTING_SLICE blobs, the lock taken per slice, no blob's
        recency changed (eviction stays least recently used): a change made meanwhile may
        show as a passing difference."""
        with self._lock:
            ids = self.memory.ids() + self.disk.ids()
        held, seen = 0, set()
        for start in range(0, len(ids), ACCOUNTING_SLICE):
            with self._lock:
                for blob_id in ids[start : start + ACCOUNTING_SLICE]:
                    blob = None if blob_id in seen else self._find(blob_id)
                    seen.add(blob_id)
                    held += blob.nbytes if blob is not None else 0
        with self._lock:
            return held, sum(self.stats.usage.values())

    def counts(self, owner: str | None = None) -> dict[str, int]:
        """Chunks and artifacts held (only `owner`'s when given) and leased blobs."""
        with self._lock:
            ids = set(self.memory.ids()) | set(self.disk.ids())
            if owner is not None:
                ids = {i for i in ids if self._find(i).owner == owner}
            return {
                "chunks": sum(1 for i in ids if i[0] == "chunk"),
                "artifacts": sum(1 for i in ids if i[0] == "artifact"),
                "leased": len(self._leases),
            }

    def flush(self) -> int:
        """Write memory-only blobs to the disk tier (graceful shutdown). Returns how many."""
        written = 0
        with self._mutating() as failed:
            if not self.disk.capacity:
                return 0
            for blob_id in self.memory.ids():
                blob = self.memory.get(blob_id)
                if blob_id in self.disk or not self.disk.fits(blob.nbytes):
                    continue
                self._disk_room(blob.nbytes)
                self.disk.write(blob)
                written += 1
        return written - len(failed)


class FetchStream:
    """Leased chunks being read: every chunk of a layer, then the next layer. `close`
    releases the leases (idempotent); reading checks every segment's checksum."""

    def __init__(self, shard: Shard, blobs: list[Blob], layer_start: int, layer_end: int):
        self.shard, self.blobs = shard, blobs
        self.layer_start, self.layer_end = layer_start, layer_end
        self._closed = False
        self.total_bytes = sum(b.segment_bytes for b in blobs) * (layer_end - layer_start)

    def layers(self) -> Iterator[tuple[int, list[bytes | memoryview], list[int]]]:
        """(layer, each chunk's segment, each one's stored CRC-32C): a layer is read and
        checked whole before it is handed out; the CRCs go with the bytes to the client,
        which checks them again on arrival."""
        for layer in range(self.layer_start, self.layer_end):
            segments = self.layer(layer)
            self.shard.stats.fetched_bytes += sum(len(s) for s in segments)
            yield layer, segments, [blob.crcs[layer] for blob in self.blobs]

    def layer(self, layer: int) -> list[bytes | memoryview]:
        """Every chunk's segment of `layer` (K then V), each checked against its stored
        CRC-32C (`DataLoss` when one fails), from whichever tier holds it."""
        return [self.shard._read_segment(blob, layer) for blob in self.blobs]

    def segments(self) -> Iterator[tuple[int, int, bytes | memoryview, int]]:
        for layer, segments, crcs in self.layers():
            for index, (data, crc) in enumerate(zip(segments, crcs, strict=True)):
                yield layer, index, data, crc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.shard._release([b.id for b in self.blobs])


class PutSession:
    """One two-phase put: segments are staged privately; `commit` checks and publishes.

    Each chunk's bytes land in one buffer of its own, allocated when its first segment
    arrives and holding exactly the chunk: a received message is copied out of, never kept
    (its unknown fields or padding pin nothing), and every byte buffered is first held in
    the owner's share of the receive budget (`Reservation.grow`)."""

    def __init__(
        self, shard, namespace, layout, ids, indices, owner, quota, signatures, weight=None
    ) -> None:
        self.shard, self.namespace, self.layout = shard, namespace, layout
        self.owner, self.quota = owner, quota
        keys = chunk_keys(ids, layout, namespace.salt)
        if len(indices) > len(keys):
            raise InvalidArgument(f"header.chunk_indices: more than the {len(keys)} chunks")
        self.indices = list(indices)
        self._check_indices(len(keys))
        self.signatures = self._check_signatures(signatures)
        parents = parent_keys(keys, layout, namespace.salt)
        self.tokens = [_chunk_tokens(ids, layout, i) for i in self.indices]
        ends = [min((i + 1) * layout.chunk_tokens, len(ids)) for i in self.indices]
        self.token_digests = token_digests(ids, ends) if self.signatures else []
        self.keys = [keys[i] for i in self.indices]
        self.parents = [parents[i] for i in self.indices]
        total = sum(layout.chunk_bytes(len(t)) for t in self.tokens)
        if total > shard.config.max_put_bytes:
            raise InvalidArgument(
                f"put: {total} bytes exceed the per-put limit of {shard.config.max_put_bytes}"
            )
        sizes = [layout.chunk_bytes(len(t)) for t in self.tokens]
        new = shard.new_bytes(namespace, self.keys, sizes)
        self.reservation = shard.reserve(owner, quota(owner), total, new, weight=weight)
        self.total_bytes = total
        self.segments: list[list[bytes | memoryview | None]] = [
            [None] * layout.num_layers for _ in self.tokens
        ]
        self.arrays: list[np.ndarray | None] = [None] * len(self.tokens)
        self.received = 0

    def _slot(self, j: int, layer: int) -> memoryview:
        """Where layer `layer` of chunk `j` goes in the chunk's own buffer (uninitialised:
        every byte of it is written before the commit)."""
        size = self.layout.segment_bytes(len(self.tokens[j]))
        if self.arrays[j] is None:
            self.arrays[j] = np.empty(size * self.layout.num_layers, dtype=np.uint8)
        return memoryview(self.arrays[j])[layer * size : (layer + 1) * size]

    def _check_signatures(self, signatures: Sequence[bytes]) -> list[bytes]:
        if signatures and len(signatures) != len(self.indices):
            raise InvalidArgument(
                f"header.signatures: {len(signatures)} given, one per chunk ({len(self.indices)}) "
                "or none expected"
            )
        return list(signatures)

    def _check_indices(self, n_chunks: int) -> None:
        if not self.indices:
            raise InvalidArgument("header.chunk_indices: at least one chunk is required")
        if len(set(self.indices)) != len(self.indices):
            raise InvalidArgument("header.chunk_indices: indices must be unique")
        if min(self.indices) < 0 or max(self.indices) >= n_chunks:
            raise InvalidArgument(f"header.chunk_indices: must be in [0, {n_chunks})")

    def layer_views(self, layer: int) -> list[memoryview]:
        """Where one layer of every chunk goes, as writable views in data-plane wire order
        (K then V, per head, per chunk); the layer counts as received once filled. Each
        chunk gets one uninitialised buffer for all its layers (no zero-fill pass: the
        socket writes every byte of it)."""
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidArgument(f"frame.layer: {layer} is not in [0, {self.layout.num_layers})")
        if any(self.segments[j][layer] is not None for j in range(len(self.indices))):
            raise InvalidArgument(f"frame: layer {layer} sent twice")
        self.reservation.grow(self.layer_bytes)
        buffers = []
        for j in range(len(self.tokens)):
            buffers.append(self._slot(j, layer))
            self.segments[j][layer] = buffers[-1]
        self.received += len(buffers)
        row_bytes = self.layout.head_dim * self.layout.itemsize
        lengths = [len(t) for t in self.tokens]
        return head_major(buffers, lengths, self.layout.num_kv_heads, row_bytes)

    @property
    def layer_bytes(self) -> int:
        return sum(self.layout.segment_bytes(len(t)) for t in self.tokens)

    def add(self, layer: int, chunk: int, data) -> None:
        """Stage one segment: `data` (a view of a received message) is copied into the
        chunk's own buffer, its bytes first held in the receive budget."""
        if not 0 <= chunk < len(self.indices):
            raise InvalidArgument(f"segment.chunk: {chunk} is not in [0, {len(self.indices)})")
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidArgument(f"segment.layer: {layer} is not in [0, {self.layout.num_layers})")
        size = self.layout.segment_bytes(len(self.tokens[chunk]))
        if len(data) != size:
            raise InvalidArgument(
                f"segment.data: layer {layer} of chunk {chunk} has {len(data)} bytes, "
                f"expected {size} (K and V of {len(self.tokens[chunk])} tokens)"
            )
        if self.segments[chunk][layer] is not None:
            raise InvalidArgument(f"segment: layer {layer} of chunk {chunk} sent twice")
        self.reservation.grow(size)
        slot = self._slot(chunk, layer)
        slot[:] = data
        self.segments[chunk][layer] = slot
        self.received += 1

    def commit(self, crcs: Sequence[int]) -> Committed:
        expected = len(self.indices) * self.layout.num_layers
        if self.received != expected:
            raise InvalidArgument(
                f"commit: {expected - self.received} of {expected} segments are missing"
            )
        if len(crcs) != len(self.indices):
            raise InvalidArgument(f"commit.crc32c: expected {len(self.indices)} values")
        blobs = [self._blob(j, crc) for j, crc in enumerate(crcs)]
        self.close()  # the commit checks quota and room itself, under the shard's lock
        return self.shard.commit(blobs, self.owner, self.quota)

    def close(self) -> None:
        """Release what the put reserved (idempotent): after its commit, or when it ends
        without one."""
        self.reservation.release()

    def _blob(self, j: int, crc: int) -> Blob:
        data = tuple(self.segments[j])
        if combined_crc(data) != crc:
            raise InvalidArgument(f"commit.crc32c[{j}]: chunk {j} arrived corrupted")
        self.segments[j] = []
        digest = content_digest(data)
        signature = self.signatures[j] if self.signatures else b""
        signed = signature != b"" and self.shard.check_signature(
            chunk_statement(self.layout, self.token_digests[j], digest),
            signature,
            f"header.signatures[{j}]",
        )
        return Blob(
            id=("chunk", self.namespace.id, self.keys[j]),
            layout=self.layout,
            owner=self.owner,
            tokens=tuple(self.tokens[j]),
            segment_bytes=self.layout.segment_bytes(len(self.tokens[j])),
            crcs=tuple(crc32c(segment) for segment in data),
            data=data,
            meta={
                "parent": self.parents[j],
                "digest": digest.hex(),
                "signature": signature.hex(),
                "signed": signed,
            },
        )
