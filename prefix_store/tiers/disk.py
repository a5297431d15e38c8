"""The disk tier: one file per blob, written atomically, found again when a shard restarts.

File format: b"VCB1", a little-endian u32 header length, a JSON header (id, layout, owner,
tokens, segment size, per-segment CRC-32C), then the data. Files are written to a
temporary name and renamed, so a crash never leaves a half-written blob visible.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from prefix_store.blob import Blob, BlobId
from prefix_store.layout import KVLayout

MAGIC = b"VCB1"
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
    return Blob(
        id=_tupled(header["id"]),
        layout=KVLayout(**header["layout"]),
        owner=header["owner"],
        tokens=tuple(header["tokens"]),
        segment_bytes=header["segment_bytes"],
        crcs=tuple(header["crcs"]),
        meta=header["meta"],
    )


class DiskTier:
    """Holds at most `capacity` bytes of blob data under `root`. Not thread-safe: the shard
    serialises index changes; `read_segment` of a leased blob may run concurrently."""

    def __init__(self, root: Path, capacity: int, leased: Callable[[BlobId], bool]) -> None:
        self.root = Path(root)
        self.capacity = capacity
        self._leased = leased
        self._index: OrderedDict[BlobId, tuple[Blob, Path, int]] = OrderedDict()
        self.used = 0
        if capacity > 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._scan()

    def _scan(self) -> None:
        """Index the blobs left by an earlier run, oldest access first."""
        found = []
        for path in self.root.glob("*.blob"):
            try:
                blob, offset = self._read_header(path)
            except (OSError, ValueError, KeyError, TypeError) as error:
                log.warning("disk tier: dropping unreadable %s (%s)", path.name, error)
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime, blob, path, offset))
        for _, blob, path, offset in sorted(found, key=lambda item: item[0]):
            self._index[blob.id] = (blob, path, offset)
            self.used += blob.nbytes
        for stale in self.root.glob("*.tmp"):
            stale.unlink(missing_ok=True)

    @staticmethod
    def _read_header(path: Path) -> tuple[Blob, int]:
        with path.open("rb") as f:
            if f.read(4) != MAGIC:
                raise ValueError("bad magic")
            (length,) = struct.unpack("<I", f.read(4))
            blob = _blob_of(json.loads(f.read(length)))
        return blob, 8 + length

    def _path(self, blob_id: BlobId) -> Path:
        name = hashlib.sha256(json.dumps(blob_id).encode()).hexdigest()[:40]
        return self.root / f"{name}.blob"

    def __contains__(self, blob_id: BlobId) -> bool:
        return blob_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    def ids(self) -> list[BlobId]:
        return list(self._index)

    def get(self, blob_id: BlobId) -> Blob | None:
        """The blob's description (data None), now most recently used; or None."""
        entry = self._index.get(blob_id)
        if entry is None:
            return None
        self._index.move_to_end(blob_id)
        return entry[0]

    def fits(self, nbytes: int) -> bool:
        free = self.capacity - self.used
        free += sum(e[0].nbytes for i, e in self._index.items() if not self._leased(i))
        return nbytes <= free

    def make_room(self, nbytes: int) -> list[Blob]:
        """Delete unleased blobs, least recently used first, until `nbytes` fit."""
        victims = []
        for blob_id in list(self._index):
            if self.used + nbytes <= self.capacity:
                break
            if not self._leased(blob_id):
                victims.append(self.remove(blob_id))
        return victims

    def write(self, blob: Blob) -> None:
        """Store a blob (the caller has made room); atomic via rename."""
        assert blob.data is not None
        path = self._path(blob.id)
        header = _header(blob)
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header)
            for segment in blob.data:
                f.write(segment)
        os.replace(tmp, path)
        self._forget(blob.id)
        self._index[blob.id] = (blob.without_data(), path, 8 + len(header))
        self.used += blob.nbytes

    def read_segment(self, blob_id: BlobId, index: int) -> bytes:
        blob, path, offset = self._index[blob_id]
        with path.open("rb") as f:
            data = os.pread(f.fileno(), blob.segment_bytes, offset + index * blob.segment_bytes)
        if len(data) != blob.segment_bytes:
            raise OSError(f"{path.name}: short read of segment {index}")
        return data

    def read(self, blob_id: BlobId) -> Blob:
        blob, path, offset = self._index[blob_id]
        size = blob.segment_bytes
        with path.open("rb") as f:
            data = tuple(
                os.pread(f.fileno(), size, offset + i * size) for i in range(len(blob.crcs))
            )
        if any(len(segment) != size for segment in data):
            raise OSError(f"{path.name}: short read")
        return dataclasses.replace(blob, data=data)

    def remove(self, blob_id: BlobId) -> Blob | None:
        entry = self._forget(blob_id)
        if entry is None:
            return None
        entry[1].unlink(missing_ok=True)
        return entry[0]

    def _forget(self, blob_id: BlobId):
        entry = self._index.pop(blob_id, None)
        if entry is not None:
            self.used -= entry[0].nbytes
        return entry
