"""The store's bulk data-plane framing, both ends: what a shard's `data_plane` sends and
reads and what the client's `client.transfer` reads and sends. Plain functions on sockets;
nothing here holds state or knows tenants.

A fetched layer is one frame: 16 bytes header (magic b"VCL2", u32 layer, u32 chunks, u32 n),
then each chunk's stored CRC-32C of that layer's segment (u32 each, request order), then n
bytes ordered as the client's tensors are: K then V; per KV head; per chunk (request
order) that head's rows [tokens, head_dim]. So a run of consecutive chunks is one
contiguous region per head on both sides. The client checks every chunk's CRC over its
bytes in stored order (K heads then V heads) before it uses the layer, so corruption in
transit is caught end to end. Put frames are the same without the CRCs (magic b"VCL1": the
commit carries each chunk's checksum). Every segment of a chunk layer passes its checksum
on the shard before the layer is sent; a failure is a frame b"VCER" whose n bytes are UTF-8
"STATUS_CODE_NAME\nmessage" (the gRPC code the same failure has there), after which the
connection closes. A refusal by the server's bounds (busy: try again later, as a gRPC
refusal carrying `retry-after-ms`) carries the milliseconds in the header's layer field
(0 otherwise; readers before the mark ignore it); RESOURCE_EXHAUSTED without it is the
tenant's quota or a full store, which waiting does not cure.

Puts go the same way in the other direction (`OpenPut`): the client sends one frame per
layer from its tensors, then a commit frame b"VCCM" carrying each chunk's CRC-32C (u32
each); the shard answers b"VCOK" with a serialised PutResponse, or b"VCER".

An artifact is one such frame of one "chunk" at layer 0, its bytes as stored: a fetch
(`OpenFetchArtifact`) is b"VCL2" with the stored CRC-32C, the shard checking the bytes
against it as it sends them, a piece at a time (a failure drops its copy; the client,
which checks the same CRC, has refused the bytes already); a put (`OpenPutArtifact`) is
b"VCL1", then b"VCCM" with one CRC-32C, answered as a put of chunks is.

A connection opens with `redemption(ticket, token)`: the ticket an Open* call returned
and HMAC-SHA256(token_key(token), ticket), so only the tenant it was issued to
redeems it. With TLS the same frames flow inside the TLS session; TLS has no
scatter-gather send, so `send_buffers` coalesces segments into records of up to
TLS_RECORD_BATCH bytes there.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import ssl
import struct
from typing import NamedTuple

HEADER = struct.Struct("<4sIII")
OK = b"VCL1"
CHECKED = b"VCL2"
COMMIT = b"VCCM"
DONE = b"VCOK"
IOV_BATCH = 512
ERROR = b"VCER"
TICKET_BYTES = 16
PROOF_BYTES = 32
"""A connection opens with its ticket and a proof of the tenant it was issued to:
HMAC-SHA256(token_key(bearer token), ticket) (`redemption`)."""
SOCKET_BUFFER = 4 << 20
TLS_RECORD_BATCH = 256 << 10


def token_key(token: str) -> bytes:
    """What a shard keeps of a tenant's token to check its data-plane proofs (keyed apart
    from the token digest that Redis stores, so reading Redis does not give it)."""
    return hmac.new(token.encode(), b"vericache data-plane ticket", hashlib.sha256).digest()


def redemption(ticket: bytes, token: str) -> bytes:
    """What a client sends first on a data-plane connection: the ticket and its proof."""
    return ticket + hmac.new(token_key(token), ticket, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill a flat (format "B") view."""
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the data connection mid-transfer")
        view = view[n:]


def pack_crcs(crcs) -> bytes:
    return struct.pack(f"<{len(crcs)}I", *crcs)


class InBandError(NamedTuple):
    """An error frame's content."""

    code: str
    """The gRPC status code's name."""
    message: str
    retry_after_ms: int | None = None
    """Set on a refusal by the server's bounds (busy): when it may be tried again."""


def error_frame(code: str, message: str, retry_after_ms: int | None = None) -> bytes:
    text = f"{code}\n{message}".encode()[:65536]
    return HEADER.pack(ERROR, retry_after_ms or 0, 0, len(text)) + text


def read_frame_header(sock: socket.socket) -> tuple[bytes, int, int, int]:
    header = bytearray(HEADER.size)
    recv_exact(sock, memoryview(header))
    return HEADER.unpack(header)


def read_error(sock: socket.socket, size: int, retry_after_ms: int = 0) -> InBandError:
    """The content of an error frame whose header has been read (`retry_after_ms`: its
    layer field)."""
    body = bytearray(min(size, 65536))
    recv_exact(sock, memoryview(body))
    code, _, message = body.decode(errors="replace").partition("\n")
    return InBandError(code, message, retry_after_ms or None)


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """sendmsg the buffers in order, resuming after partial sends (TLS: `send_coalesced`)."""
    if isinstance(sock, ssl.SSLSocket):
        send_coalesced(sock, buffers)
        return
    pending = [b for b in buffers if b.nbytes]
    first = 0
    while first < len(pending):
        sent = sock.sendmsg(pending[first : first + IOV_BATCH])
        while sent and first < len(pending):
            size = pending[first].nbytes
            if sent >= size:
                sent -= size
                first += 1
            else:
                pending[first] = pending[first][sent:]
                sent = 0


def send_coalesced(sock: ssl.SSLSocket, buffers: list) -> None:
    """Send byte views in order: small ones joined up to TLS_RECORD_BATCH, large ones as they
    are (a TLS socket has no sendmsg)."""
    batch = bytearray()
    for buffer in buffers:
        if batch and len(batch) + buffer.nbytes > TLS_RECORD_BATCH:
            sock.sendall(batch)
            batch.clear()
        if buffer.nbytes >= TLS_RECORD_BATCH:
            sock.sendall(buffer)
        else:
            batch += buffer
    if batch:
        sock.sendall(batch)


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
