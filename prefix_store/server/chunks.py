"""The store's chunk methods: Lookup, Put (over gRPC) and OpenPut (a data-plane ticket),
Fetch (over gRPC) and OpenFetch (a data-plane ticket), and Delete.

A Put stream arrives serialised (`protocol.wire`): its header first, then segment batches,
then the commit; nothing of a message is kept while the next one is awaited, and the stream
keeps to its deadline and minimum rate (`pace`). A data-plane ticket pins what it fetches
(its chunks leased) until it is redeemed or expires, within its tenant's share of the
shard's bytes (`Service.pinned`).
"""

from __future__ import annotations

from vericache.v1 import prefix_store_pb2 as pb

from prefix_store import faults
from prefix_store.data_plane import head_major, send_frames
from prefix_store.errors import Aborted, InvalidArgument
from prefix_store.namespace import OWNER
from prefix_store.pace import Pace
from prefix_store.protocol import wire
from prefix_store.provenance import Proof
from prefix_store.server.requests import layout_of
from prefix_store.server.service import Service
from prefix_store.server.transfers import once, receive_put
from prefix_store.shard import ChunkRef, Deletable
from rpc.handler import streaming, unary
from rpc.server import client_stream, parse

MAX_CHUNKS_PER_FETCH = 1 << 16


def proof_message(proof: Proof) -> pb.ChunkProof:
    return pb.ChunkProof(digest=proof.digest, signature=proof.signature)


class Chunks:
    """Lookup, Put, OpenPut, Fetch, OpenFetch and Delete over the shard's chunks."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.gate = service.gate
        self.leases = service.pinned

    @unary
    def Lookup(self, request, call):
        tenant, space = self.service.caller(call, request.namespace)
        result = self.service.shard.lookup(
            space, layout_of(request), request.token_ids, request.chunk_indices
        )
        asked = len(set(request.chunk_indices)) if request.chunk_indices else len(result.keys)
        self.service.metrics.looked_up(
            tenant.name, len(result.present), asked - len(result.present)
        )
        return pb.LookupResponse(
            chunk_keys=result.keys,
            present=result.present,
            partial_index=result.partial_index,
            partial_tokens=result.partial_tokens,
            partial_key=result.partial_key,
            cached_tokens=result.cached_tokens,
            proofs=[proof_message(p) for p in result.proofs],
            partial_proof=proof_message(result.partial_proof),
        )

    @unary
    def Put(self, request_iterator, call):
        """Requests arrive serialised (see `wire`): each segment is parsed as a view of its
        message and copied into the put's own buffers (the message is not kept). The bytes
        that arrived stay reserved until the put commits or ends (`PutSession.close`); the
        stream keeps to its deadline and minimum rate (`pace`)."""
        pace = Pace(self.service.config.puts, 0)
        with self.service.pacer.watch(call, pace):
            return self._put(client_stream(request_iterator), call, pace)

    def _put(self, messages, call, pace: Pace):
        session = None
        try:
            for raw in messages:
                self.service.check_size("PutRequest", len(raw))
                if session is None:
                    session = self._put_header(raw, call, pace)
                else:
                    done = self._put_part(session, raw, pace)
                    if done is not None:
                        return done
                del raw  # nothing of a message is kept while the next one is awaited
            raise Aborted("put: the stream ended before its commit; nothing was stored")
        finally:
            if session is not None:
                session.close()

    def _put_header(self, raw, call, pace: Pace):
        part, value = wire.decode_put(raw)
        if part != "header":
            raise InvalidArgument("put: the first message must be a header")
        self.service.check_size("PutHeader", len(value), self.service.request_limit("OpenPut"))
        session = self._begin_put(parse(pb.PutHeader, value), call)
        pace.declare(session.total_bytes)
        return session

    @staticmethod
    def _put_part(session, raw, pace: Pace) -> pb.PutResponse | None:
        """A message after the header: segments (copied into the session), or the commit
        (its response)."""
        part, value = wire.decode_put(raw)
        if part == "segments":
            for layer, chunk, data, _ in value:
                session.add(layer, chunk, data)
            pace.arrived(sum(len(data) for _, _, data, _ in value))
            return None
        if part == "commit":
            done = session.commit(list(parse(pb.PutCommit, value).crc32c))
            return pb.PutResponse(
                chunk_keys=done.keys, stored_bytes=done.new_bytes, new_keys=done.new_keys
            )
        raise InvalidArgument(f"put: unexpected {part or 'empty'} message after header")

    def _begin_put(self, header, call):
        tenant, space = self.service.writer(call, header.namespace)
        return self.service.shard.begin_put(
            space,
            layout_of(header),
            header.token_ids,
            header.chunk_indices,
            tenant.name,
            self.service.quota,
            header.signatures,
            getattr(tenant, "weight", None),
        )

    def _fetch_args(self, request, call):
        _, space = self.service.caller(call, request.namespace)
        layout = layout_of(request)
        if not 0 < len(request.chunks) <= MAX_CHUNKS_PER_FETCH:
            raise InvalidArgument(f"chunks: between 1 and {MAX_CHUNKS_PER_FETCH} required")
        end = request.layer_end or layout.num_layers
        refs = [ChunkRef(c.key, c.tokens, c.digest) for c in request.chunks]
        return space, layout, refs, request.layer_start, end

    @unary
    def OpenFetch(self, request, call):
        if self.service.data_plane is None:
            raise InvalidArgument("OpenFetch: this shard has no data plane; use Fetch")
        space, layout, refs, start, end = self._fetch_args(request, call)
        tenant = call.caller
        leased = sum(layout.segment_bytes(ref.tokens) for ref in refs) * layout.num_layers
        self.leases.acquire(tenant.name, leased, tenant.weight)
        try:
            stream = self.service.shard.open_fetch(space, layout, refs, start, end)
        except BaseException:
            self.leases.release(tenant.name, leased)
            raise
        close = once(stream.close, lambda: self.leases.release(tenant.name, leased))
        tokens = [ref.tokens for ref in refs]
        row_bytes = layout.head_dim * layout.itemsize
        frames = (
            (layer, crcs, head_major(segments, tokens, layout.num_kv_heads, row_bytes))
            for layer, segments, crcs in stream.layers()
        )
        return self.service.ticket(
            call, lambda conn: send_frames(conn, frames), close, stream.total_bytes
        )

    @unary
    def OpenPut(self, request, call):
        if self.service.data_plane is None:
            raise InvalidArgument("OpenPut: this shard has no data plane; use Put")
        session = self._begin_put(request, call)
        total = session.layer_bytes * session.layout.num_layers
        receive = lambda conn: receive_put(conn, session, self.service.config.puts)  # noqa: E731
        return self.service.ticket(call, receive, session.close, total)

    @streaming
    def Fetch(self, request, call):
        space, layout, refs, start, end = self._fetch_args(request, call)
        message_bytes = self.service.message_bytes(request.max_message_bytes)
        for batch in self.service.shard.fetch(space, layout, refs, start, end, message_bytes):
            # Serialised here (see `wire`): one copy of the stored bytes into the message.
            yield wire.fetch_response(
                [(lyr, c, faults.TRANSIT.tamper([d]), crc) for lyr, c, d, crc in batch]
            )

    @unary
    def Delete(self, request, call):
        """Deletes what the caller may: a namespace's owner anything in it, a writer what it
        stored itself (its quota pays for it); readers nothing."""
        tenant, space = self.service.writer(call, request.namespace)
        if len(request.chunk_keys) > MAX_CHUNKS_PER_FETCH:
            raise InvalidArgument(f"chunk_keys: at most {MAX_CHUNKS_PER_FETCH} per call")
        mine = Deletable(tenant.name, space.role == OWNER)
        if request.chunk_keys:
            chunks, artifacts, nbytes = self.service.shard.delete_keys(
                space, request.chunk_keys, mine
            )
        else:
            chunks, artifacts, nbytes = self.service.shard.delete(
                space, layout_of(request), request.token_ids, mine
            )
        return pb.DeleteResponse(chunks=chunks, artifacts=artifacts, bytes=nbytes)
