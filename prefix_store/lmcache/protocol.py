"""LMCache's remote server protocol (`lm://`, LMCache 0.5.6), server side, sans-IO.

A client frame is a fixed header, `ClientHeader.SIZE` = 186 bytes: nine int32 (command,
length, memory format, dtype code, location code, shape[4]) then the key string, 150 bytes
ASCII padded with spaces (LMCache `ClientMetaMessage`). A PUT's header is followed by
`length` bytes of payload. A server reply is nine int32 (code, length, memory format, dtype
code, shape[4], location code; LMCache `ServerMetaMessage`), followed for a GET hit by
`length` bytes. Integers are in the host's byte order at standard size, as LMCache packs
them (`struct` native order without alignment: the two agree for these formats).

Replies by command (what LMCache 0.5.6's own server answers):
- PUT: none (the protocol has no acknowledgement; a refused put is simply not stored).
- GET: SUCCESS with the stored format, dtype, shape and bytes; FAIL with length 0 on a miss.
- EXIST: SUCCESS or FAIL, length 0.
- HEALTH: SUCCESS.
- LIST: the reference server leaves it unimplemented; the gateway answers FAIL.

Format, dtype and shape codes are opaque here: stored with the bytes, returned unchanged.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from prefix_store.lmcache.errors import ProtocolError

MAX_KEY_LENGTH = 150
"""LMCache's `MAX_KEY_LENGTH`: the key field's width in a client header."""

_CLIENT = struct.Struct(f"=9i{MAX_KEY_LENGTH}s")
_SERVER = struct.Struct("=9i")

FMT_KV_2LTD = 1
"""LMCache `MemoryFormat.KV_2LTD`: [2, layers, tokens, kv_heads * head_dim]."""
DTYPE_FLOAT16 = 2
"""LMCache's code for torch.float16 (what its server puts in empty replies)."""


class Command(enum.IntEnum):
    """LMCache `ClientCommand`."""

    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4
    HEALTH = 5


class ReturnCode(enum.IntEnum):
    """LMCache `ServerReturnCode`."""

    SUCCESS = 200
    FAIL = 400


class ObjectMeta(NamedTuple):
    """What LMCache says of an object's bytes; stored with them, returned on a GET."""

    fmt: int
    dtype: int
    shape: tuple[int, int, int, int]
    """Padded to 4 dimensions with trailing zeros, as on the wire."""


class ClientHeader(NamedTuple):
    """One client frame's header."""

    command: Command
    length: int
    """Payload bytes that follow (PUT); 0 otherwise."""
    meta: ObjectMeta
    key: str
    """The CacheEngineKey as a string (`model@world_size@worker_id@chunk_hash@dtype...`)."""

    SIZE = _CLIENT.size


def parse_client_header(frame: bytes, max_length: int) -> ClientHeader:
    """Parse `ClientHeader.SIZE` bytes; ProtocolError names what is wrong."""
    command, length, fmt, dtype, _location, *shape, raw_key = _CLIENT.unpack(frame)
    try:
        command = Command(command)
    except ValueError:
        raise ProtocolError(f"command: {command} is not in [1, {len(Command)}]") from None
    if command is Command.PUT and not 0 < length <= max_length:
        raise ProtocolError(f"length: {length} is not in [1, {max_length}]")
    return ClientHeader(command, length, ObjectMeta(fmt, dtype, tuple(shape)), parse_key(raw_key))


def parse_key(raw: bytes) -> str:
    """The key field as text (UTF-8, as LMCache encodes it), without its padding."""
    try:
        key = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ProtocolError("key: not UTF-8") from None
    if not key or not key.isprintable():
        raise ProtocolError(f"key: must be 1-{MAX_KEY_LENGTH} printable characters")
    return key


def reply(code: ReturnCode, length: int = 0, meta: ObjectMeta | None = None) -> bytes:
    """A server header; without `meta`, the empty-object fields LMCache's server sends."""
    meta = meta or ObjectMeta(FMT_KV_2LTD, DTYPE_FLOAT16, (0, 0, 0, 0))
    return _SERVER.pack(int(code), length, meta.fmt, meta.dtype, *meta.shape, 0)


def client_header(command: Command, key: str, length: int = 0, meta: ObjectMeta | None = None):
    """A client header (tests and tools; LMCache's client builds its own)."""
    meta = meta or ObjectMeta(FMT_KV_2LTD, DTYPE_FLOAT16, (0, 0, 0, 0))
    padded = key.encode().ljust(MAX_KEY_LENGTH)
    return _CLIENT.pack(int(command), length, meta.fmt, meta.dtype, 0, *meta.shape, padded)
