"""The decoder's store clients: one per caller token, which decides what the caller may read.

A token is known iff the store's Describe with it succeeds, and a `StoreClient` describes
when it is built: so a client exists only for a known token, and a token the store refuses
leaves nothing cached and nothing open (the client closes itself). A kept client's token
is asked about again (Describe) when it was last accepted more than `recheck_s` ago, so a
rotated or removed token is refused within that (plus the store's own token cache). At
most `limit` clients are kept, the least recently used evicted first; an evicted client is
closed as soon as no call holds it and no cached prefix reads through it (`in_use`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager

from prefix_store.client import StoreClient
from prefix_store.config import ClientConfig
from prefix_store.errors import Unauthenticated


class StoreClients:
    """Per-token store clients, bounded (LRU). Thread-safe."""

    def __init__(
        self,
        endpoints: Sequence[str],
        config: ClientConfig,
        limit: int,
        recheck_s: float,
        in_use: Callable[[], Collection[StoreClient]] = tuple,
    ) -> None:
        """in_use: the clients that cached state (prefixes) reads through: not closed."""
        self.endpoints = list(endpoints)
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

    def get(self, token: str) -> StoreClient:
        """The caller's client, built (so its token checked) on first use. Raises the
        store's Unauthenticated for an unknown token, Unavailable when the store cannot say."""
        with self.held(token) as client:
            return client

    @contextmanager
    def held(self, token: str) -> Iterator[StoreClient]:
        """`get`, and the client is not closed before the block ends (a call's duration)."""
        client = self._acquire(token)
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

    def _acquire(self, token: str) -> StoreClient:
        with self._lock:
            client = self._take(token)
            if client is not None:
                self._holds[client] += 1
                stale = self._accepted[client] + self.recheck_s < time.monotonic()
        if client is not None:
            return self._recheck(token, client) if stale else client
        built = StoreClient(self.endpoints, token, self.config)  # Describe: raises if unknown
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
