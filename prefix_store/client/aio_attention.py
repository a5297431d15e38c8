"""Near-data attention on asyncio: `AsyncAttentionSession`, the `AttentionSession` of
`AsyncStoreClient`. The same policy object (`near_data.AttendRoute`: which shard serves
each chunk, what a failed stream means, the checks and the assembly), over grpc.aio
bidirectional streams instead of threads: one stream per owner shard, a query written to
all of them and their answers awaited together; a failed stream is replaced by streams to
replicas, which get the query again (a stream the shard cut as quiet is first reopened on
the same shard, as in the threaded session).
"""

from __future__ import annotations

import asyncio
import time

import grpc.aio
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.client.core import ClientCore
from prefix_store.client.near_data import (
    AttendPart,
    AttendRoute,
    Query,
    SessionBase,
    cut_while_quiet,
)
from prefix_store.errors import Unavailable


class AsyncAttendLink:
    """One Attend stream to one shard on grpc.aio: its header goes with the first query;
    each query is written, then its answer read."""

    def __init__(self, part: AttendPart, method, header: pb.AttendRequest, metadata) -> None:
        self.part = part
        self.call = method(metadata=metadata)
        self.header: pb.AttendRequest | None = header
        self.answered = 0
        """Answers received: a stream that answered before may since have been cut as quiet."""
        self.cut = False
        """Whether the query's write found the stream already over (a shard gone, or the
        shard's quiet cut crossing the query): `near_data.cut_while_quiet` reopens it once."""

    @property
    def ended(self) -> bool:
        """Whether the stream is over (the shard closed or cut it, or it failed)."""
        return self.call.done()

    async def exchange(self, query: Query, timeout_s: float) -> pb.AttendResponse:
        """`query`'s answer; raises the stream's error, or Unavailable when the writes and
        the answer take over `timeout_s` together (a shard that stalls without closing)."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._exchange(query)
        except TimeoutError:
            self.close()
            raise Unavailable(
                f"attend: {self.part.shard_id} did not answer within {timeout_s} s"
            ) from None

    async def _exchange(self, query: Query) -> pb.AttendResponse:
        broke = False
        try:
            if self.header is not None:
                await self.call.write(self.header)
                self.header = None
            await self.call.write(query.request)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            broke = True  # the stream is over: reading it gives its status
        try:
            item = await self.call.read()
        except grpc.aio.AioRpcError as error:
            if broke and error.code() == grpc.StatusCode.INTERNAL:
                # the failed write ended the call itself, with a generic status: the stream
                # was over before the query went out (a shard gone, or a quiet cut)
                self.cut = True
                raise Unavailable(
                    f"attend: the stream to {self.part.shard_id} was over before the query"
                ) from error
            raise
        if item is grpc.aio.EOF:
            raise Unavailable(f"attend: {self.part.shard_id} ended the stream")
        self.answered += 1
        return item

    def close(self) -> None:
        self.call.cancel()


class AsyncAttentionSession(SessionBase):
    """As `AttentionSession` (`query(layer, q)` gives the partials of every full chunk,
    bitwise what the kernel computes locally), with `await`: one query at a time; `close`
    (or `async with`) ends the streams. Counters: see `SessionBase`."""

    def __init__(self, core: ClientCore, connections, route: AttendRoute) -> None:
        super().__init__(core, connections, route)
        self._links: list[AsyncAttendLink] = []
        self._busy = False

    async def query(self, layer: int, q):
        """Partials of `q` ([rows, heads, head_dim] float32) over every chunk, or raises
        (`KernelMismatch`, `NotFound`, `Unavailable`, `LimitExceeded`, `InvalidArgument`)."""
        if self._busy:
            raise RuntimeError("attend: one query at a time per session")
        query = self.route.query(layer, q)
        self._busy, start = True, time.perf_counter()
        try:
            if not self._links:
                self._links = self._opened(self.route.start())
            self._links = [self._revived(link) for link in self._links]
            found = await _all([self._answers(link, query) for link in self._links])
        except BaseException:
            self._drop_links()  # no stale answer may be read by a later query
            raise
        finally:
            self._busy = False
            self.wire_s += time.perf_counter() - start
        answers = [answer for some in found for answer in some]
        self.shard_s += max(response.compute_s for _, response in answers)
        self.queries += 1
        return self.route.assemble(query, answers)

    async def _answers(self, link: AsyncAttendLink, query: Query) -> list:
        """`query`'s (part, response) from `link`, or from the links replacing it."""
        try:
            self.bytes_sent += query.request.ByteSize()
            response = await link.exchange(query, self.core.deadlines.idle)
            self.bytes_received += response.ByteSize()
            self.route.check(link.part, query, response)
            return [(link.part, response)]
        except Exception as error:  # noqa: BLE001 - the route decides: replica or failure
            link.close()
            self._links.remove(link)
            quiet = cut_while_quiet(link, error)
            parts = [link.part] if quiet else self.route.failed(link.part, error)
            fresh = self._opened(parts)
            self._links.extend(fresh)
            found = await _all([self._answers(new, query) for new in fresh])
            return [answer for some in found for answer in some]

    def _revived(self, link: AsyncAttendLink) -> AsyncAttendLink:
        """A link whose stream ended while idle, reopened on the same shard."""
        if not link.ended:
            return link
        link.close()
        return self._open(link.part)

    def _opened(self, parts: list[AttendPart]) -> list[AsyncAttendLink]:
        """A link per part, one by one: a failed open leaves none of them open."""
        links: list[AsyncAttendLink] = []
        try:
            for part in parts:
                links.append(self._open(part))
        except BaseException:
            for link in links:
                link.close()
            raise
        return links

    def _open(self, part: AttendPart) -> AsyncAttendLink:
        header = self.route.header(part)
        self.bytes_sent += header.ByteSize()
        stub = self._conn.stub(self.core.address(part.shard_id))
        return AsyncAttendLink(part, stub.Attend, header, self._conn.metadata)

    def _drop_links(self) -> None:
        links, self._links = self._links, []
        for link in links:
            link.close()

    async def close(self) -> None:
        """Close every stream (idempotent); the shards release the chunks' leases."""
        self._drop_links()

    async def __aenter__(self) -> AsyncAttentionSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def _all(jobs: list) -> list:
    """Every job's result; when one raises, the others are cancelled (and awaited) first."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
