"""The disk tier: one file per blob, durable once written, found again when a shard restarts.

File format: b"VCB1", a little-endian u32 header length, a JSON header (id, layout, owner,
tokens, segment size, per-segment CRC-32C, meta), then the data.

Crash consistency: a blob is written to a temporary file, fsynced, renamed to a name no
other write uses, and the directory is fsynced; removals are unlinked and the directory
fsynced. A crash therefore leaves every blob either whole or absent (at worst an older
copy of a blob written again, which the start-up scan resolves to the newest).

The shard never holds its lock across disk I/O. A write is staged (under the shard's lock:
the bytes are accounted and the blob stays readable from memory), performed (`perform`,
without the lock) and settled (under the lock again: the memory copy is dropped, or the
blob forgotten if the write failed). `take_io` hands the staged work to the caller.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prefix_store.blob import Blob, BlobId
from prefix_store.errors import InvalidArgument
from prefix_store.layout import KVLayout

MAGIC = b"VCB1"
UNUSABLE = (OSError, ValueError, KeyError, TypeError, struct.error, OverflowError)
UNUSABLE += (RecursionError, InvalidArgument)
"""What reading a file that is not a whole blob raises (torn, foreign, a hostile header)."""
log = logging.getLogger(__name__)


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _header(blob: Blob) -> bytes:
    return json.dumps(
        {
            "id": blob.id,
            "layout": dataclasses.asdict(blob.layout),
            "owner": blob.owner,
            "tokens": blob.tokens,
            "segment_bytes": blob.segment_bytes,
            "crcs": blob.crcs,
            "meta": blob.meta,
        }
    ).encode()


def _blob_of(header: dict) -> Blob:
    """The blob a header describes; ValueError (or KeyError, TypeError) if it is not one a
    shard could have written."""
    blob = Blob(
        id=_tupled(header["id"]),
        layout=KVLayout(**header["layout"]),
        owner=str(header["owner"]),
        tokens=tuple(int(t) for t in header["tokens"]),
        segment_bytes=int(header["segment_bytes"]),
        crcs=tuple(int(c) for c in header["crcs"]),
        meta=dict(header["meta"]),
    )
    hash(blob.id)  # TypeError if a part of it is not hashable (a JSON object)
    kind = blob.id[0] if blob.id else None
    if kind not in ("chunk", "artifact") or len(blob.id) < 3 or not isinstance(blob.id[2], int):
        raise ValueError(f"not a chunk or artifact id: {blob.id!r}")
    if blob.segment_bytes <= 0 or not blob.crcs:
        raise ValueError("no data")
    if kind == "chunk":
        if len(blob.crcs) != blob.layout.num_layers:
            raise ValueError(f"{len(blob.crcs)} segments for {blob.layout.num_layers} layers")
        if not 0 < len(blob.tokens) <= blob.layout.chunk_tokens:
            raise ValueError(f"{len(blob.tokens)} tokens in a chunk")
        if len(blob.tokens) < blob.layout.chunk_tokens and "parent" not in blob.meta:
            raise ValueError("a partial chunk without its parent key")
    return blob


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(eq=False)
class Write:
    """A staged write of one blob (its data in memory until it is settled)."""

    blob: Blob
    path: Path
    offset: int
    header: bytes
    error: OSError | None = None


@dataclass
class DiskIO:
    """Disk work staged under the shard's lock, to be performed without it."""

    writes: list[Write] = field(default_factory=list)
    unlinks: list[Path] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.writes or self.unlinks)


@dataclass(eq=False)
class _Entry:
    blob: Blob
    """Without data once on disk; with it while its write is in flight."""
    path: Path
    offset: int
    write: Write | None = None


def read_file_header(path: Path) -> tuple[Blob, int]:
    """A blob file's header and the offset of its data, checked against the file's size
    (ValueError naming what is wrong: the scan rejects the file)."""
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise ValueError("bad magic")
        (length,) = struct.unpack("<I", f.read(4))
        if 8 + length > os.fstat(f.fileno()).st_size:  # never allocate a declared length
            raise ValueError(f"a header of {length} bytes runs past the end of the file")
        header = f.read(length)
        if len(header) != length:
            raise ValueError("truncated header")
        blob = _blob_of(json.loads(header))
        size = os.fstat(f.fileno()).st_size
    offset = 8 + length
    if size != offset + blob.nbytes:
        raise ValueError(f"{size} bytes, expected {offset + blob.nbytes}")
    return blob, offset


def write_file(write: Write) -> None:
    """Write a blob file durably: to a temporary name, fsynced, then renamed into place."""
    tmp = write.path.with_suffix(".tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(write.header)) + write.header)
            for segment in write.blob.data:
                f.write(segment)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, write.path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


class DiskTier:
    """Holds at most `capacity` bytes of blob data under `root`. Not thread-safe: the shard
    serialises index changes (everything but `perform`, `read_segment` and `read`, which
    run without its lock; reads are of leased blobs only)."""

    def __init__(self, root: Path, capacity: int, leased: Callable[[BlobId], bool]) -> None:
        self.root = Path(root)
        self.capacity = capacity
        self._leased = leased
        self._index: OrderedDict[BlobId, _Entry] = OrderedDict()
        self._io = DiskIO()
        self.used = 0
        self.rejected: list[tuple[str, str]] = []
        """(file name, reason) of every file the start-up scan could not use (removed)."""
        self.write_errors = 0
        if capacity > 0:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.root.chmod(0o700)  # blobs' headers hold tenants' token ids
            self._scan()

    # ---- start-up ----------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the blobs left by an earlier run, oldest access first. Files it cannot
        read as a whole blob (truncated, foreign, bad header) are reported and removed;
        of two files of one blob (a crash between a rewrite and its cleanup) the newest
        is kept."""
        found: dict[BlobId, tuple[float, Blob, Path, int]] = {}
        for path in sorted(self.root.glob("*.blob")):
            try:
                blob, offset = read_file_header(path)
                mtime = path.stat().st_mtime
            except UNUSABLE as error:
                self._reject(path, f"{type(error).__name__}: {error}")
                continue
            older = found.get(blob.id)
            if older is not None and older[0] > mtime:
                self._reject(path, "an older copy of a blob written again")
                continue
            if older is not None:
                self._reject(older[2], "an older copy of a blob written again")
            found[blob.id] = (mtime, blob, path, offset)
        for _, blob, path, offset in sorted(found.values(), key=lambda item: item[0]):
            self._index[blob.id] = _Entry(blob, path, offset)
            self.used += blob.nbytes
        for stale in self.root.glob("*.tmp"):
            stale.unlink(missing_ok=True)
        if self.rejected:
            _fsync_dir(self.root)

    def _reject(self, path: Path, reason: str) -> None:
        log.warning("disk tier %s: removing unusable %s (%s)", self.root, path.name, reason)
        self.rejected.append((path.name, reason))
        path.unlink(missing_ok=True)

    # ---- the index (under the shard's lock) -------------------------------------------

    def _path(self, blob_id: BlobId) -> Path:
        """A name no earlier write of the blob used (so an in-flight write never overwrites
        the file of a settled one)."""
        name = hashlib.sha256(json.dumps(blob_id).encode()).hexdigest()[:40]
        return self.root / f"{name}.{secrets.token_hex(4)}.blob"

    def __contains__(self, blob_id: BlobId) -> bool:
        return blob_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    def ids(self) -> list[BlobId]:
        return list(self._index)

    def get(self, blob_id: BlobId) -> Blob | None:
        """The blob's description (its data only while its write is in flight), now most
        recently used; or None."""
        entry = self._index.get(blob_id)
        if entry is None:
            return None
        self._index.move_to_end(blob_id)
        return entry.blob

    def peek(self, blob_id: BlobId) -> Blob | None:
        """The blob's description, or None, leaving its recency as it is."""
        entry = self._index.get(blob_id)
        return None if entry is None else entry.blob

    def fits(self, nbytes: int) -> bool:
        free = self.capacity - self.used
        free += sum(e.blob.nbytes for i, e in self._index.items() if not self._leased(i))
        return nbytes <= free

    def make_room(self, nbytes: int) -> list[Blob]:
        """Remove unleased blobs, least recently used first, until `nbytes` fit."""
        victims = []
        for blob_id in list(self._index):
            if self.used + nbytes <= self.capacity:
                break
            if not self._leased(blob_id):
                victims.append(self.remove(blob_id))
        return victims

    def write(self, blob: Blob) -> None:
        """Stage a blob's write (the caller has made room): it is indexed and accounted now,
        readable from its data until the write settles."""
        assert blob.data is not None
        self._forget(blob.id)
        header = _header(blob)
        write = Write(blob, self._path(blob.id), 8 + len(header), header)
        self._index[blob.id] = _Entry(blob, write.path, write.offset, write)
        self.used += blob.nbytes
        self._io.writes.append(write)

    def remove(self, blob_id: BlobId) -> Blob | None:
        entry = self._forget(blob_id)
        if entry is None:
            return None
        self._io.unlinks.append(entry.path)  # an in-flight write's file: removed when written
        return entry.blob.without_data()

    def _forget(self, blob_id: BlobId) -> _Entry | None:
        entry = self._index.pop(blob_id, None)
        if entry is not None:
            self.used -= entry.blob.nbytes
        return entry

    def take_io(self) -> DiskIO:
        """The disk work staged since the last call, for `perform` (without the lock)."""
        io, self._io = self._io, DiskIO()
        return io

    def settle(self, write: Write) -> bool:
        """After `perform`: the blob now reads from disk; or, if its write failed, it is
        forgotten and True is returned (the rest of its accounting is the caller's)."""
        entry = self._index.get(write.blob.id)
        current = entry is not None and entry.write is write
        if write.error is None:
            if current:
                entry.blob, entry.write = write.blob.without_data(), None
            else:  # removed while in flight: its file may have appeared after the unlink
                self._io.unlinks.append(write.path)
            return False
        self.write_errors += 1
        if current:
            self._forget(write.blob.id)
        return current

    # ---- disk I/O (without the shard's lock) ------------------------------------------

    def perform(self, io: DiskIO) -> None:
        """Do staged work: each write to a temporary file, fsynced, then renamed; unlinks;
        then one directory fsync. A failed write is recorded on it (`Write.error`), its
        temporary file removed. A blob removed while its write was in flight in another
        thread may get its file after the unlink: `settle` then stages the unlink again."""
        for write in io.writes:
            try:
                write_file(write)
            except OSError as error:
                log.error("disk tier %s: writing %s failed: %s", self.root, write.path.name, error)
                write.error = error
        for path in io.unlinks:
            path.unlink(missing_ok=True)
        if io.writes or io.unlinks:
            try:
                _fsync_dir(self.root)
            except OSError as error:
                log.error("disk tier %s: directory fsync failed: %s", self.root, error)
                for write in io.writes:
                    write.error = write.error or error

    def read_segment(self, blob_id: BlobId, index: int) -> bytes:
        entry = self._index[blob_id]
        blob, path, offset = entry.blob, entry.path, entry.offset
        with path.open("rb") as f:
            data = os.pread(f.fileno(), blob.segment_bytes, offset + index * blob.segment_bytes)
        if len(data) != blob.segment_bytes:
            raise OSError(f"{path.name}: short read of segment {index}")
        return data

    def read(self, blob_id: BlobId) -> Blob:
        entry = self._index[blob_id]
        if entry.blob.data is not None:
            return entry.blob
        blob, path, offset = entry.blob, entry.path, entry.offset
        size = blob.segment_bytes
        with path.open("rb") as f:
            data = tuple(
                os.pread(f.fileno(), size, offset + i * size) for i in range(len(blob.crcs))
            )
        if any(len(segment) != size for segment in data):
            raise OSError(f"{path.name}: short read")
        return dataclasses.replace(blob, data=data)
