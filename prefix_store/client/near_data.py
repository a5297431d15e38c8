"""Near-data attention from the client: `AttentionSession` sends a verification pass's
query rows to the shards that hold a prefix's chunks (gRPC `Attend`, one bidirectional
stream per owner shard) and gathers the per-chunk attention partials they compute, instead
of pulling the prefix's KV.

`AttendRoute` is the policy, without I/O: which full chunks take part, which shard serves
each (a chunk is placed by its parent key; shards that do not advertise the caller's kernel
are passed over), what a failed stream means, and how the answers are checked (shape,
layer, CRC-32C) and assembled in chunk order. A stream that fails with UNAVAILABLE,
DATA_LOSS (corrupt at rest or in transit), NOT_FOUND, a deadline or a cancel is reopened
on the next live replica of its chunks and the current query is sent again (UNAVAILABLE
quarantines the shard, as for a fetch). A stream that answered earlier queries and is then
cancelled (or, on asyncio, found over by the query's write) was most likely cut by the
shard for being quiet (`CallBounds.stream_idle_s`) just as the query went out: it is
reopened on the same shard once first. With no replica left the query fails (NotFound
when every copy was missing or corrupt, else Unavailable). A shard without the caller's
kernel (FAILED_PRECONDITION) is `KernelMismatch`; a refusal over the shard's limits is
`LimitExceeded`; every other status fails at once. A query either returns partials for
every chunk or raises: the caller then pulls the KV (`StoreClient.fetch_layers`).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.blob import crc32c
from prefix_store.client.core import ClientCore, exhausted, failover_error
from prefix_store.client.plan import CachedPrefix, ChunkPlan, Topology, group_by_owner
from prefix_store.client.retry import rpc_error
from prefix_store.errors import (
    CorruptInTransit,
    DataLoss,
    InvalidArgument,
    KernelMismatch,
    NotFound,
    StoreError,
    Unavailable,
)
from prefix_store.protocol.attend import FLOAT32, MAX_ROWS

if TYPE_CHECKING:
    import torch

    from numerics.cpu import partials as attention


def full_chunks(prefix: CachedPrefix) -> tuple[ChunkPlan, ...]:
    """The prefix's leading full chunks (a partial last chunk takes no part)."""
    size = prefix.layout.chunk_tokens
    return tuple(c for c in prefix.chunks if c.tokens == size)


def kernels_match(topology: Topology, chunks: Sequence[ChunkPlan], kernel: str) -> bool:
    """Whether every owner of every chunk advertises `kernel` (from Describe)."""
    return bool(kernel) and all(
        topology.attention_kernels.get(shard_id) == kernel
        for chunk in chunks
        for shard_id in topology.owners(chunk.parent)
    )


def typed_error(error: BaseException) -> BaseException:
    """A failed stream's error as the store's typed error (a busy refusal: LimitExceeded)."""
    return rpc_error(error) if isinstance(error, grpc.RpcError) else error


@dataclass(frozen=True, slots=True)
class AttendPart:
    """One stream's share of the session: chunks served by one shard."""

    shard_id: str
    chunks: tuple[ChunkPlan, ...]
    failed: frozenset[str] = frozenset()
    """Shards these chunks already failed on in this session."""


@dataclass(frozen=True, slots=True)
class Query:
    """One query as sent: its request and its geometry."""

    layer: int
    rows: int
    request: pb.AttendRequest


class AttendRoute:
    """One session's policy: parts, failover, checks and assembly (no I/O). Thread-safe as
    far as its core is; the session calls it from one thread."""

    def __init__(self, core: ClientCore, prefix: CachedPrefix, heads: int, kernel: str):
        layout = prefix.layout
        if layout.dtype != "float32" or layout.head_dim % 8 or layout.chunk_tokens % 8:
            raise InvalidArgument(
                "attend: needs a float32 layout with head_dim and chunk_tokens multiples of 8"
            )
        if heads < 1 or heads % layout.num_kv_heads:
            raise InvalidArgument(
                f"heads: {heads} is not a multiple of layout.num_kv_heads ({layout.num_kv_heads})"
            )
        self.core, self.prefix, self.heads, self.kernel = core, prefix, heads, kernel
        self.chunks = full_chunks(prefix)
        if not self.chunks:
            raise NotFound("attend: the prefix has no full cached chunk")
        self._position = {c.index: i for i, c in enumerate(self.chunks)}

    # ---- where each chunk is served ---------------------------------------------------------

    def start(self) -> list[AttendPart]:
        return self._spread(self.chunks, frozenset(), None)

    def failed(self, part: AttendPart, error: BaseException) -> list[AttendPart]:
        """The parts that continue a failed one on replicas; raises when none may."""
        cause = failover_error(error)
        if cause is None:
            raise typed_error(error) from error
        self.core.count(f"failover.{type(cause).__name__}")
        if isinstance(cause, Unavailable):
            self.core.failed(part.shard_id)
        return self._spread(part.chunks, part.failed | {part.shard_id}, cause)

    def _spread(
        self, chunks: Sequence[ChunkPlan], failed: frozenset, cause: StoreError | None
    ) -> list[AttendPart]:
        """`chunks` by their best owner that is not in `failed` and serves our kernel."""
        topology = self.core.topology
        others = frozenset(s for s in topology.shards if self._kernel_of(s) != self.kernel)
        try:
            groups = self.core.groups(chunks, failed | others)
        except NotFound as error:
            raise self._no_owner(chunks, failed, error, cause) from cause
        return [AttendPart(s, tuple(group), failed) for s, group in groups.items()]

    def _kernel_of(self, shard_id: str) -> str:
        return self.core.topology.attention_kernels.get(shard_id, "")

    def _no_owner(self, chunks, failed, error: NotFound, cause) -> StoreError:
        """Why no shard is left: another kernel on the live owners, else `exhausted`."""
        try:
            groups = group_by_owner(chunks, self.core.topology, failed)
        except NotFound:
            return exhausted(error, failed, cause)
        kernels = sorted({self._kernel_of(s)[:16] or "none" for s in groups})
        return KernelMismatch(
            f"attend: no live owner of the prefix's chunks serves kernel {self.kernel[:16]!r} "
            f"(they have {', '.join(kernels)}); fetch the KV instead"
        )

    def kernels_match(self, kernel: str | None = None) -> bool:
        """Whether every owner of the session's chunks advertises `kernel` (default: the
        session's): then no shard will refuse it, replicas included."""
        return kernels_match(
            self.core.topology, self.chunks, self.kernel if kernel is None else kernel
        )

    # ---- messages ---------------------------------------------------------------------------

    def header(self, part: AttendPart) -> pb.AttendRequest:
        prefix = self.prefix
        refs = [pb.ChunkRef(key=c.key, tokens=c.tokens, digest=c.proof.digest) for c in part.chunks]
        return pb.AttendRequest(
            header=pb.AttendHeader(
                namespace=prefix.namespace,
                layout=prefix.layout.to_proto(pb),
                chunks=refs,
                kernel=self.kernel,
                heads=self.heads,
            )
        )

    def query(self, layer: int, q: torch.Tensor) -> Query:
        """The query of `q` ([rows, heads, head_dim] float32, rotated and scaled)."""
        import torch  # only near-data decoding needs torch: routers and gateways never do

        layout = self.prefix.layout
        if not 0 <= layer < layout.num_layers:
            raise InvalidArgument(f"layer: {layer} is not in [0, {layout.num_layers})")
        if (
            q.dtype != torch.float32
            or q.dim() != 3
            or tuple(q.shape[1:])
            != (
                self.heads,
                layout.head_dim,
            )
        ):
            raise InvalidArgument(
                f"q: {q.dtype} {tuple(q.shape)}; expected float32 [rows, {self.heads}, "
                f"{layout.head_dim}]"
            )
        rows = q.shape[0]
        if not 1 <= rows <= MAX_ROWS:
            raise InvalidArgument(f"q: {rows} rows; 1 to {MAX_ROWS} per query")
        data = q.detach().to("cpu").contiguous().numpy().tobytes()
        request = pb.AttendRequest(query=pb.AttendQuery(layer=layer, rows=rows, q=data))
        return Query(layer, rows, request)

    # ---- answers ----------------------------------------------------------------------------

    def check(self, part: AttendPart, query: Query, response: pb.AttendResponse) -> None:
        """DataLoss unless `response` is whole: the query's layer, shapes, CRC-32C."""
        count, d = len(part.chunks), self.prefix.layout.head_dim
        scores = count * query.rows * self.heads * FLOAT32
        sizes = (len(response.m), len(response.l), len(response.acc))
        if response.layer != query.layer or sizes != (scores, scores, scores * d):
            raise DataLoss(
                f"attend: {part.shard_id} answered layer {response.layer} with {sizes} bytes; "
                f"expected layer {query.layer} with {(scores, scores, scores * d)}"
            )
        if crc32c(response.acc, crc32c(response.l, crc32c(response.m))) != response.crc32c:
            raise CorruptInTransit(
                f"attend: partials of layer {query.layer} from {part.shard_id} arrived "
                "corrupted (CRC-32C mismatch in transit)"
            )

    def assemble(
        self, query: Query, answers: Sequence[tuple[AttendPart, pb.AttendResponse]]
    ) -> attention.Partials:
        """The session's `attention.Partials` in chunk order, from every part's answer."""
        import torch

        from numerics.cpu import partials as attention

        c, t, h, d = len(self.chunks), query.rows, self.heads, self.prefix.layout.head_dim
        m, l_ = torch.empty(c, t, h), torch.empty(c, t, h)  # [C, T, H]
        acc = torch.empty(c, t, h, d)  # [C, T, H, D]
        covered = 0
        for part, response in answers:
            where = torch.tensor([self._position[chunk.index] for chunk in part.chunks])
            n = len(part.chunks)
            m.index_copy_(0, where, floats(response.m, (n, t, h)))
            l_.index_copy_(0, where, floats(response.l, (n, t, h)))
            acc.index_copy_(0, where, floats(response.acc, (n, t, h, d)))
            covered += n
        if covered != c:
            raise DataLoss(f"attend: answers cover {covered} of {c} chunks")  # a bug, never served
        return attention.Partials(m=m, l=l_, acc=acc)


def floats(data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only float32 view of received bytes (the kernel's little-endian layout)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read
        return torch.frombuffer(data, dtype=torch.float32).view(shape)


_END = None
"""What ends a stream's request queue."""


def cut_while_quiet(link, error: BaseException) -> bool:
    """Whether `link` failed the way a stream the shard cut for quietness fails when the
    cut crosses the next query (`AttentionSession._revived` catches the cuts seen before
    it), after answering earlier queries: cancelled, or (asyncio) found already over by the
    query's write (`AsyncAttendLink.cut`)."""
    code = error.code() if isinstance(error, grpc.RpcError) else None
    cut = getattr(link, "cut", False)
    return link.answered > 0 and (code == grpc.StatusCode.CANCELLED or cut)


class AttendLink:
    """One Attend stream to one shard, open for the session: requests go through a queue
    that gRPC consumes; a reader thread puts each response (or the stream's end, as an
    error) into another queue."""

    def __init__(self, part: AttendPart, method, header: pb.AttendRequest, metadata) -> None:
        self.part = part
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._requests.put(header)
        self._call = method(iter(self._requests.get, _END), metadata=metadata)
        self.answered = 0
        """Answers received: a stream that answered before may since have been cut as quiet."""
        self.ended = threading.Event()
        """Set once the response stream is over (the shard closed or cut it, or it failed)."""
        reader = threading.Thread(target=self._read, name=f"attend-{part.shard_id}", daemon=True)
        reader.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self._responses.put(response)
            self._responses.put(Unavailable(f"attend: {self.part.shard_id} ended the stream"))
        except grpc.RpcError as error:
            self._responses.put(error)
        finally:
            self.ended.set()

    def send(self, query: Query) -> None:
        self._requests.put(query.request)

    def receive(self, timeout_s: float) -> pb.AttendResponse:
        """The next answer; raises the stream's error, or Unavailable after `timeout_s`."""
        try:
            item = self._responses.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise Unavailable(
                f"attend: {self.part.shard_id} did not answer within {timeout_s} s"
            ) from None
        if isinstance(item, BaseException):
            raise item
        self.answered += 1
        return item

    def close(self) -> None:
        self._requests.put(_END)
        self._call.cancel()


class SessionBase:
    """What the threaded and the asyncio session share: the route, the chunks it covers and
    the counters: `bytes_sent`/`bytes_received` (messages), `wire_s` (time waiting on the
    shards), `shard_s` (the shards' compute on that path: per query, the slowest shard's)."""

    def __init__(self, core: ClientCore, connections, route: AttendRoute) -> None:
        self.core, self._conn, self.route = core, connections, route
        self.bytes_sent = self.bytes_received = 0
        self.wire_s = self.shard_s = 0.0
        self.queries = 0

    @property
    def chunks(self) -> tuple[ChunkPlan, ...]:
        """The full chunks the partials cover, in order (a partial last chunk is not one)."""
        return self.route.chunks

    @property
    def tokens(self) -> int:
        """Tokens the partials cover."""
        return sum(c.tokens for c in self.chunks)

    def kernels_match(self, kernel: str | None = None) -> bool:
        return self.route.kernels_match(kernel)


class AttentionSession(SessionBase):
    """Near-data attention over one cached prefix's full chunks (`chunks`), for one
    decoder thread: `query(layer, q)` returns `attention.Partials` ([C, T, H] m and l,
    [C, T, H, D] acc, chunk order) computed by the shards, bitwise what
    `attention.chunk_partials` gives locally on the same chunks. Streams open at the first
    query and stay open until `close` (or a failed query, after which the next one opens
    them again). Not thread-safe: one query at a time. Counters: see `SessionBase`."""

    def __init__(self, core: ClientCore, connections, route: AttendRoute) -> None:
        super().__init__(core, connections, route)
        self._links: list[AttendLink] = []
        self._pending: Query | None = None

    def query(self, layer: int, q: torch.Tensor):
        """Partials of `q` ([rows, heads, head_dim] float32) over every chunk, or raises
        (`KernelMismatch`, `NotFound`, `Unavailable`, `LimitExceeded`, `InvalidArgument`)."""
        self.submit(layer, q)
        return self.collect()

    def submit(self, layer: int, q: torch.Tensor) -> None:
        """Send a query to every shard without waiting for the answers (`collect` them), so a
        caller can work, or query other sessions' shards, meanwhile. One query at a time."""
        if self._pending is not None:
            raise RuntimeError("attend: collect() the query in flight before submitting another")
        query = self.route.query(layer, q)
        start = time.perf_counter()
        try:
            if not self._links:
                for part in self.route.start():  # one by one: a failed open leaks none opened
                    self._links.append(self._open(part))
            for i, link in enumerate(self._links):
                self._links[i] = self._revived(link)
            for link in self._links:
                self._send(link, query)
        except BaseException:
            self._drop_links()  # no stale answer may be read by a later query
            raise
        finally:
            self.wire_s += time.perf_counter() - start
        self._pending = query

    def collect(self):
        """The partials of the submitted query (see `query`)."""
        query, self._pending = self._pending, None
        if query is None:
            raise RuntimeError("attend: no query in flight")
        start = time.perf_counter()
        try:
            answers = self._collect(query)
        except BaseException:
            self._drop_links()
            raise
        finally:
            self.wire_s += time.perf_counter() - start
        self.shard_s += max(response.compute_s for _, response in answers)
        self.queries += 1
        return self.route.assemble(query, answers)

    def _send(self, link: AttendLink, query: Query) -> None:
        link.send(query)
        self.bytes_sent += query.request.ByteSize()

    def _collect(self, query: Query) -> list[tuple[AttendPart, pb.AttendResponse]]:
        """Every link's answer to `query`; a failed link is replaced by links to replicas,
        which get `query` again."""
        answers: dict[AttendLink, tuple[AttendPart, pb.AttendResponse]] = {}
        pending = list(self._links)
        while pending:
            link = pending.pop(0)
            try:
                response = link.receive(self.core.deadlines.idle)
                self.bytes_received += response.ByteSize()
                self.route.check(link.part, query, response)
                answers[link] = (link.part, response)
            except Exception as error:  # noqa: BLE001 - the route decides: replica or failure
                pending.extend(self._replace(link, error, query))
        return [answers[link] for link in self._links]

    def _replace(self, link: AttendLink, error: BaseException, query: Query) -> list[AttendLink]:
        link.close()
        self._links.remove(link)
        if cut_while_quiet(link, error):
            fresh = [self._open(link.part)]  # answered == 0: a second cancel fails over
        else:
            fresh = [self._open(part) for part in self.route.failed(link.part, error)]
        for new in fresh:
            self._send(new, query)
        self._links.extend(fresh)
        return fresh

    def _revived(self, link: AttendLink) -> AttendLink:
        """A link whose stream ended while idle (the shard cut a quiet stream), reopened on
        the same shard; a shard that is gone then fails the query over to a replica."""
        if not link.ended.is_set():
            return link
        link.close()
        return self._open(link.part)

    def _open(self, part: AttendPart) -> AttendLink:
        address = self.core.address(part.shard_id)
        header = self.route.header(part)
        self.bytes_sent += header.ByteSize()
        return AttendLink(part, self._conn.stub(address).Attend, header, self._conn.metadata)

    def _drop_links(self) -> None:
        self._pending = None
        links, self._links = self._links, []
        for link in links:
            link.close()

    def close(self) -> None:
        """Close every stream (idempotent); the shards release the chunks' leases."""
        self._drop_links()

    def __enter__(self) -> AttentionSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
