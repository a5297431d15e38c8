"""Blob files of the disk tier (`prefix_store.tiers.disk`): b"VCB1", a u32 header length,
a JSON header, the data. A shard scans them at start-up; the clear error for a file it
cannot use as a whole blob (truncated, foreign, a bad or hostile header) is that the file
is reported in `DiskTier.rejected` and removed, and the shard starts: nothing escapes the
scan, and no declared length is allocated. An intact file is indexed as it was written."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_store.blob import Blob, crc32c
from prefix_store.layout import KVLayout
from prefix_store.tiers.disk import MAGIC, DiskTier
from tests.fuzz.mutate import memory_cap, mutated

CAPACITY = 1 << 20
LAYOUT = KVLayout("fuzz@1", "float16", num_layers=2, num_kv_heads=1, head_dim=2, chunk_tokens=16)


@pytest.fixture
def tmp_dirs():
    """Fresh directories, in memory where the host has /dev/shm (a tier fsyncs each write),
    removed at the end."""
    root = Path(tempfile.mkdtemp(prefix="fuzz-tier-", dir=_shm()))
    count = iter(range(1 << 30))
    yield lambda: root / str(next(count))
    shutil.rmtree(root, ignore_errors=True)


def _shm() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


@st.composite
def blobs(draw) -> Blob:
    """A chunk or an artifact as a shard writes them."""
    if draw(st.booleans()):
        tokens = tuple(draw(st.lists(st.integers(0, 2**31), min_size=16, max_size=16)))
        size = LAYOUT.segment_bytes(16)
        data = tuple(draw(st.binary(min_size=size, max_size=size)) for _ in range(2))
        blob_id = ("chunk", draw(st.text(max_size=8)), draw(st.integers(0, 2**64 - 1)))
        meta = {"parent": draw(st.integers(0, 2**64 - 1)), "signed": draw(st.booleans())}
    else:
        data = (draw(st.binary(min_size=1, max_size=64)),)
        size, tokens = len(data[0]), (draw(st.integers(1, 4096)),)
        blob_id = ("artifact", "ns", draw(st.integers(0, 2**64 - 1)), "kivi", LAYOUT.identity())
        meta = {}
    crcs = tuple(crc32c(d) for d in data)
    return Blob(blob_id, LAYOUT, draw(st.text(max_size=8)), tokens, size, crcs, data, meta)


def write_file(directory: Path, blob: Blob) -> Path:
    """The blob as the disk tier writes it (its own write path)."""
    tier = DiskTier(directory, CAPACITY, lambda _: False)
    tier.write(blob)
    io = tier.take_io()
    tier.perform(io)
    tier.settle(io.writes[0])
    return io.writes[0].path


def file_bytes(tmp: Path, blob: Blob) -> bytes:
    path = write_file(tmp, blob)
    raw = path.read_bytes()
    path.unlink()
    return raw


def scan(directory: Path, raw: bytes) -> DiskTier:
    """A shard's start-up scan of one file holding `raw`: it starts whatever the bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "0123.blob"
    path.write_bytes(raw)
    with memory_cap():
        tier = DiskTier(directory, CAPACITY, lambda _: False)
    if len(tier):
        (blob_id,) = tier.ids()
        blob = tier.read(blob_id)
        assert len(raw) >= sum(len(d) for d in blob.data)
    else:
        assert [name for name, _ in tier.rejected] == [path.name]
        assert not path.exists()
    return tier


def header_file(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    size = len(header) if length is None else length
    return MAGIC + struct.pack("<I", size) + header + data


@given(blobs())
def test_blob_files_round_trip(tmp_dirs, blob):
    directory = tmp_dirs()
    write_file(directory, blob)
    tier = DiskTier(directory, CAPACITY, lambda _: False)
    assert tier.ids() == [blob.id]
    assert tier.read(blob.id) == blob
    assert tier.rejected == []


@given(st.data())
def test_damaged_blob_files_are_rejected(tmp_dirs, data):
    directory = tmp_dirs()
    raw = file_bytes(directory, data.draw(blobs()))
    scan(directory, data.draw(mutated(st.just(raw))))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
FIELDS = ("id", "layout", "owner", "tokens", "segment_bytes", "crcs", "meta")


@given(st.data())
def test_headers_with_wrong_types_are_rejected(tmp_dirs, data):
    directory = tmp_dirs()
    blob = data.draw(blobs())
    raw = file_bytes(directory, blob)
    (length,) = struct.unpack_from("<I", raw, 4)
    header = json.loads(raw[8 : 8 + length])
    for name in data.draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
        if data.draw(st.booleans()):
            header[name] = data.draw(JSON)
        else:
            header.pop(name, None)
    text = json.dumps(header).encode()
    scan(directory, header_file(text, raw[8 + length :]))


def test_hostile_headers_are_rejected(tmp_dirs):
    """Found by the properties above; each one stopped the shard from starting."""
    good = {
        "id": ["chunk", "", 7],
        "layout": {
            "model_id": "m",
            "dtype": "float16",
            "num_layers": 1,
            "num_kv_heads": 1,
            "head_dim": 1,
            "chunk_tokens": 16,
        },
        "owner": "t",
        "tokens": list(range(16)),
        "segment_bytes": 64,
        "crcs": [0],
        "meta": {},
    }
    cases = [
        header_file(b"{}", length=0xFFFFFFFF),  # a header length of 4 GiB: was read whole
        header_file(b"[" * 100_000),  # nested past the recursion limit
        header_file(json.dumps({**good, "tokens": [1e400] * 16}).encode(), bytes(64)),
        header_file(json.dumps({**good, "id": ["chunk", {}, 7]}).encode(), bytes(64)),
        header_file(json.dumps({**good, "layout": {**good["layout"], "num_layers": 0}}).encode()),
    ]
    for raw in cases:
        scan(tmp_dirs(), raw)
