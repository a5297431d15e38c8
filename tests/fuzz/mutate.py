"""Structure-aware mutation: build a valid message, frame or file with a strategy, then
damage it the ways a hostile peer or a torn write would (truncate, flip bits, insert or
delete bytes, overwrite with huge lengths or sizes, splice in unknown fields), and run
parsers under a memory cap so that a declared size is never allocated."""

from __future__ import annotations

import contextlib
import resource
import struct
from collections.abc import Iterator

from hypothesis import settings
from hypothesis import strategies as st

CAP = 256 << 20
"""Address space a parser may grow by while it reads one example (`memory_cap`)."""

HUGE_VARINTS = (
    b"\xff\xff\xff\xff\x0f",  # 2**32 - 1
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # 2**64 - 1
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f",  # more than 64 bits
    b"\x80" * 11,  # never ends
    b"\x80",  # truncated
)
HUGE_U32 = (
    struct.pack("<I", 0xFFFFFFFF),
    struct.pack("<I", 0x7FFFFFFF),
    struct.pack("<I", 1 << 30),
)


@st.composite
def mutated(draw, base: st.SearchStrategy[bytes], max_edits: int = 4) -> bytes:
    """A value of `base` with 0..max_edits structural edits (0: the valid value itself)."""
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(0, max_edits))):
        data = draw(edit(bytes(data)))
    return bytes(data)


def edit(data: bytes) -> st.SearchStrategy[bytes]:
    n = len(data)
    at = st.integers(0, n)
    return st.one_of(
        at.map(lambda i: data[:i]),  # truncate
        st.tuples(st.integers(0, max(0, n - 1)), st.integers(0, 7)).map(lambda p: flip(data, *p)),
        st.tuples(at, st.binary(min_size=1, max_size=16)).map(
            lambda p: data[: p[0]] + p[1] + data[p[0] :]
        ),  # insert
        st.tuples(at, st.integers(1, 16)).map(lambda p: data[: p[0]] + data[p[0] + p[1] :]),
        st.tuples(at, st.sampled_from(HUGE_VARINTS + HUGE_U32)).map(
            lambda p: data[: p[0]] + p[1] + data[p[0] + len(p[1]) :]
        ),  # overwrite with a huge length, size or a malformed varint
        st.tuples(at, st.sampled_from(UNKNOWN_FIELDS)).map(
            lambda p: data[: p[0]] + p[1] + data[p[0] :]
        ),
        st.just(data + data),  # duplicated
    )


def flip(data: bytes, index: int, bit: int) -> bytes:
    if not data:
        return data
    out = bytearray(data)
    out[index] ^= 1 << bit
    return bytes(out)


UNKNOWN_FIELDS = (
    b"\xf8\x07\x01",  # field 127, varint
    b"\xfa\x07\x03abc",  # field 127, bytes
    b"\xfd\x07\x01\x02\x03\x04",  # field 127, fixed32
    b"\xf9\x07" + bytes(8),  # field 127, fixed64
    b"\xfb\x07\xfc\x07",  # field 127, an (empty) group
    b"\x00\x01",  # field 0: invalid
    b"\x0f",  # field 1, wire type 7: invalid
)


@contextlib.contextmanager
def memory_cap(extra: int = CAP) -> Iterator[None]:
    """Run the block with the process's address space capped at its current size plus
    `extra`: a parser that allocates what a hostile header declares fails with
    MemoryError (which the caller reports) instead of taking the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space() + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def share(fraction: float) -> settings:
    """Settings running `fraction` of the profile's examples: for properties whose every
    example is a round trip through real servers."""
    return settings(max_examples=max(10, int(settings.default.max_examples * fraction)))
