"""The decoder's store clients: one per caller token, which decides what the caller may read.

A token is known iff the store's Describe with it succeeds. A token without a kept client
is first checked over one connection per endpoint shared by all such checks (`TokenProbe`),
throttled per caller address (`prefix_store.throttle`: an address that tried too many
unknown tokens is refused before any I/O); only a token the store accepted gets a
`StoreClient` (its own connections and Describe). So an unknown token costs at most one
Describe on a shared connection, opens nothing and leaves nothing cached. A kept client's token
is asked about again (Describe) when it was last accepted more than `recheck_s` ago, so a
rotated or removed token is refused within that (plus the store's own token cache). At
most `limit` clients are kept, the least recently used evicted first; an evicted client is
closed as soon as no call holds it and no cached prefix reads through it (`in_use`).
All of them record their bulk reads' rate in one `LinkMeter` (`link`): the link to the
shards is the decoder's, whichever tenant reads.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager

from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.client import StoreClient
from prefix_store.client.channels import Connections
from prefix_store.client.link import LinkMeter
from prefix_store.client.retry import Attempts, retrying
from prefix_store.config import ClientConfig
from prefix_store.errors import Unauthenticated
from prefix_store.throttle import AuthBounds, FailureThrottle
from prefix_store.tls import make_channel


class TokenProbe:
    """Asks the store whether a token is known (Describe with it) over one channel per
    endpoint, shared by every check: nothing is opened or kept per token. Thread-safe."""

    def __init__(self, endpoints: Sequence[str], config: ClientConfig) -> None:
        self.endpoints = list(endpoints)
        self.config = config
        self._conn = Connections(config, "", make_channel)

    def check(self, token: str) -> None:
        """Returns when the store knows `token`; raises its Unauthenticated otherwise
        (Unavailable when no shard answers)."""
        metadata, deadline = (("authorization", f"Bearer {token}"),), self.config.timeout_s

        def describe(address: str):
            stub = self._conn.stub(address)
            return stub.Describe(pb.DescribeRequest(), metadata=metadata, timeout=deadline)

        retrying(Attempts(self.config, self.endpoints), describe)

    def close(self) -> None:
        for channel in self._conn.take():
            channel.close()


class StoreClients:
    """Per-token store clients, bounded (LRU). Thread-safe."""

    def __init__(
        self,
        endpoints: Sequence[str],
        config: ClientConfig,
        limit: int,
        recheck_s: float,
        in_use: Callable[[], Collection[StoreClient]] = tuple,
        bounds: AuthBounds | None = None,
    ) -> None:
        """in_use: the clients that cached state (prefixes) reads through: not closed.
        bounds: how many unknown tokens one caller address may try (`failures_*`)."""
        self.endpoints = list(endpoints)
        self.probe = TokenProbe(endpoints, config)
        self.link = LinkMeter()
        """The rate of every client's bulk reads (what a pull costs from here)."""
        self.throttle = FailureThrottle(bounds or AuthBounds())
        self.config = config
        self.limit = limit
        self.recheck_s = recheck_s
        self._in_use = in_use
        self._kept: OrderedDict[str, StoreClient] = OrderedDict()
        self._evicted: set[StoreClient] = set()  # let go of, but held or in use: open
        self._holds: Counter[StoreClient] = Counter()
        self._accepted: dict[StoreClient, float] = {}  # when the store last accepted its token
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Clients kept for later calls: at most `limit` once no call is being served."""
        with self._lock:
            return len(self._kept)

    def get(self, token: str, peer: str = "") -> StoreClient:
        """The caller's client, built on first use once its token is checked. Raises the
        store's Unauthenticated for an unknown token, Unavailable when the store cannot say,
        LimitExceeded when the caller's address `peer` tried too many unknown tokens."""
        with self.held(token, peer) as client:
            return client

    @contextmanager
    def held(self, token: str, peer: str = "") -> Iterator[StoreClient]:
        """`get`, and the client is not closed before the block ends (a call's duration)."""
        client = self._acquire(token, peer)
        try:
            yield client
        finally:
            self._release(client)

    def close(self) -> None:
        with self._lock:
            clients = [*self._kept.values(), *self._evicted]
            self._kept.clear()
            self._evicted.clear()
            self._accepted.clear()
        for client in clients:
            client.close()
        self.probe.close()

    def _acquire(self, token: str, peer: str) -> StoreClient:
        with self._lock:
            client = self._take(token)
            if client is not None:
                self._holds[client] += 1
                stale = self._accepted[client] + self.recheck_s < time.monotonic()
        if client is not None:
            return self._recheck(token, client) if stale else client
        self._check(token, peer)
        built = StoreClient(self.endpoints, token, self.config, link=self.link)
        with self._lock:
            client = self._take(token)
            if client is None:
                client, built = built, None
                self._kept[token] = client
                self._accepted[client] = time.monotonic()
            self._holds[client] += 1
        if built is not None:
            built.close()  # another call built this token's client first
        return client

    def _check(self, token: str, peer: str) -> None:
        """The store knows `token` (asked on the shared probe, throttled per `peer`)."""
        key = self.throttle.take(peer)  # LimitExceeded before any I/O
        try:
            self.probe.check(token)
        except Unauthenticated:
            raise  # a failure: its share of the peer's budget stays spent
        except BaseException:
            self.throttle.refund(key)
            raise
        self.throttle.refund(key)

    def _recheck(self, token: str, client: StoreClient) -> StoreClient:
        """(Held.) The client, once the store accepts its token again; else it is let go."""
        try:
            client.describe()
        except Unauthenticated:
            with self._lock:
                if self._kept.get(token) is client:
                    self._evicted.add(self._kept.pop(token))
            self._release(client)
            raise
        except BaseException:
            self._release(client)
            raise
        with self._lock:
            self._accepted[client] = time.monotonic()
        return client

    def _take(self, token: str) -> StoreClient | None:
        """(Under the lock.) The token's kept client, now the most recently used."""
        if token in self._kept:
            self._kept.move_to_end(token)
        return self._kept.get(token)

    def _release(self, client: StoreClient) -> None:
        with self._lock:
            self._holds[client] -= 1
            if self._holds[client] == 0:
                del self._holds[client]
        self._trim()

    def _trim(self) -> None:
        in_use = set(self._in_use())
        with self._lock:
            while len(self._kept) > self.limit:
                self._evicted.add(self._kept.popitem(last=False)[1])
            closing = [c for c in self._evicted if not self._busy(c, in_use)]
            for client in closing:
                self._evicted.discard(client)
                self._accepted.pop(client, None)
        for client in closing:
            client.close()

    def _busy(self, client: StoreClient, in_use: set[StoreClient]) -> bool:
        return client in self._holds or client in in_use
