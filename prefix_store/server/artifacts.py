"""The store's artifact methods: PutArtifact (the id declaring the size, then the data,
then its checksum) and FetchArtifact (the bytes in messages of the caller's size, the first
carrying the signature and the last the CRC-32C); OpenPutArtifact and OpenFetchArtifact, the
same over the data plane (a ticket; the bytes move as one frame, no gRPC message copies)."""

from __future__ import annotations

import functools

import numpy as np
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.errors import Aborted, InvalidArgument
from prefix_store.metadata.records import Tenant
from prefix_store.pace import Pace
from prefix_store.server.requests import layout_of
from prefix_store.server.service import Service
from prefix_store.server.transfers import once, receive_artifact, send_artifact
from prefix_store.shard import Reservation
from prefix_store.shard.arrival import ArrivalCheck
from rpc.handler import streaming, unary
from rpc.server import client_stream

MAX_SPEC = 256


class Artifacts:
    """PutArtifact and FetchArtifact over the shard's compressed artifacts."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.gate = service.gate

    @unary
    def PutArtifact(self, request_iterator, call):
        """The id, declaring the size (refused over quota or room before any data), then
        the data, then its checksum; the declared bytes stay reserved while they arrive."""
        messages = client_stream(request_iterator)
        first = next(messages, None)
        if first is None or first.WhichOneof("part") != "id":
            raise InvalidArgument("put_artifact: the first message must be the id")
        ident = first.id
        tenant, space = self.service.writer(call, ident.namespace)
        layout = layout_of(ident)
        self.service.config.layouts.check(layout, "id.layout")
        self._check_spec(ident.compressor)
        pace = Pace(self.service.config.puts, ident.size, "put_artifact")
        with self._admit_artifact(ident.size, tenant) as held, self.service.pacer.watch(call, pace):
            data, check = self._artifact_data(messages, ident.size, held, pace)
        return self._store(ident, space, tenant, data, check)

    def _store(self, ident, space, tenant: Tenant, data, check: ArrivalCheck) -> pb.PutResponse:
        stored = self.service.shard.put_artifact(
            space,
            layout_of(ident),
            ident.prefix_key,
            ident.prefix_tokens,
            ident.compressor,
            data,
            tenant.name,
            self.service.quota,
            ident.signature,
            check,
        )
        return pb.PutResponse(chunk_keys=[ident.prefix_key], stored_bytes=stored)

    @unary
    def OpenPutArtifact(self, request, call):
        """As PutArtifact, over the data plane: the id declares the size, refused over quota
        or room before the ticket is issued; the bytes stay reserved against the owner's
        quota until they have all arrived (or the ticket ends unused)."""
        if self.service.data_plane is None:
            raise InvalidArgument("OpenPutArtifact: this shard has no data plane; use PutArtifact")
        tenant, space = self.service.writer(call, request.namespace)
        self.service.config.layouts.check(layout_of(request), "id.layout")
        self._check_spec(request.compressor)
        held = self._admit_artifact(request.size, tenant)
        store = functools.partial(self._store, request, space, tenant)
        receive = functools.partial(
            receive_artifact, held=held, bounds=self.service.config.puts, store=store
        )
        return self.service.ticket(call, receive, held.release, request.size)

    @unary
    def OpenFetchArtifact(self, request, call):
        """As FetchArtifact, over the data plane: the ticket carries the size and the
        signature; its connection one CHECKED frame (the stored CRC-32C, then the bytes,
        read and checked against it as they are sent: `send_artifact`). The artifact is not
        leased (a put may replace it meanwhile); what the ticket may pin until it is
        redeemed counts against its tenant's share (`Service.pinned`)."""
        if self.service.data_plane is None:
            raise InvalidArgument(
                "OpenFetchArtifact: this shard has no data plane; use FetchArtifact"
            )
        ident = request.id
        tenant, space = self.service.caller(call, ident.namespace)
        self._check_spec(ident.compressor)
        read = self.service.shard.open_artifact_read(
            space, layout_of(ident), ident.prefix_key, ident.compressor
        )
        pinned = self.service.pinned
        pinned.acquire(tenant.name, read.size, tenant.weight)
        unpin = once(lambda: pinned.release(tenant.name, read.size))
        send = lambda conn: send_artifact(conn, read)  # noqa: E731
        return self.service.ticket(call, send, unpin, read.size, read.proof.signature)

    def _admit_artifact(self, size: int, tenant: Tenant) -> Reservation:
        """Refuse an artifact by its declared size, before any of its bytes is buffered."""
        if not 0 < size <= self.service.config.max_put_bytes:
            raise InvalidArgument(
                f"id.size: {size} is not in [1, {self.service.config.max_put_bytes}] (declare the "
                "artifact's size before its data)"
            )
        owner, weight = tenant.name, getattr(tenant, "weight", None)
        return self.service.shard.reserve(
            owner, self.service.quota(owner), size, size, True, weight
        )

    def _artifact_data(self, messages, declared: int, held: Reservation, pace: Pace):
        """The artifact's bytes, copied as they arrive into one buffer of the declared size
        (each part held in the receive budget first; its CRC-32C and digest computed as it
        lands), and those checks; checked against the CRC-32C sent."""
        buffer, size, check = None, 0, ArrivalCheck(1, declared)
        for message in messages:
            part = message.WhichOneof("part")
            if part == "data":
                self.service.check_size("PutArtifactRequest", message.ByteSize())
                n = len(message.data)
                if size + n > declared:
                    raise InvalidArgument(f"data: more than the declared id.size ({declared})")
                held.grow(n)
                if buffer is None:
                    buffer = np.empty(declared, dtype=np.uint8)
                piece = memoryview(buffer)[size : size + n]
                piece[:] = message.data
                check.arrived(0, piece, memoryview(buffer))
                size += n
                pace.arrived(n)
                del message  # not kept while the next one is awaited
            elif part == "crc32c":
                if size != declared:
                    raise InvalidArgument(f"data: {size} bytes arrived, {declared} declared")
                if check.crcs[0] != message.crc32c:
                    raise InvalidArgument("crc32c: the artifact arrived corrupted")
                return memoryview(buffer).toreadonly(), check
            else:
                raise InvalidArgument(f"put_artifact: unexpected {part or 'empty'} message")
        raise Aborted("put_artifact: the stream ended before its checksum; nothing was stored")

    @staticmethod
    def _check_spec(spec: str) -> None:
        if not spec or len(spec) > MAX_SPEC:
            raise InvalidArgument(f"compressor: must be 1-{MAX_SPEC} characters")

    @streaming
    def FetchArtifact(self, request, call):
        ident = request.id
        _, space = self.service.caller(call, ident.namespace)
        self._check_spec(ident.compressor)
        step = self.service.message_bytes(request.max_message_bytes)
        data, _, proof, crc = self.service.shard.fetch_artifact(
            space, layout_of(ident), ident.prefix_key, ident.compressor
        )
        if not data:
            yield pb.FetchArtifactResponse(total_bytes=0, crc32c=crc, signature=proof.signature)
        for start in range(0, len(data), step):
            first, last = start == 0, start + step >= len(data)
            yield pb.FetchArtifactResponse(
                data=bytes(data[start : start + step]),  # stored as bytes or a view
                total_bytes=len(data) if first else 0,
                crc32c=crc if last else 0,
                signature=proof.signature if first else b"",
            )
