"""The decoder's store clients: one per caller token, which decides what the caller may read.

A token is known iff the store's Describe with it succeeds, and a `StoreClient` describes
when it is built: so a client exists only for a known token, and a token the store refuses
leaves nothing cached and nothing open (the client closes itself). At most `limit` clients
are kept, the least recently used evicted first; an evicted client is closed as soon as no
call holds it and no cached prefix reads through it (`in_use`).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager

from prefix_store.client import StoreClient
from prefix_store.config import ClientConfig


class StoreClients:
    """Per-token store clients, bounded (LRU). Thread-safe."""

    def __init__(
        self,
        endpoints: Sequence[str],
        config: ClientConfig,
        limit: int,
        in_use: Callable[[], Collection[StoreClient]] = tuple,
    ) -> None:
        """in_use: the clients that cached state (prefixes) reads through: not closed."""
        self.endpoints = list(endpoints)
        self.config = config
        self.limit = limit
        self._in_use = in_use
        self._kept: OrderedDict[str, StoreClient] = OrderedDict()
        self._evicted: dict[str, StoreClient] = {}  # still held or in use: closed later
        self._holds: Counter[StoreClient] = Counter()
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
            clients = [*self._kept.values(), *self._evicted.values()]
            self._kept.clear()
            self._evicted.clear()
        for client in clients:
            client.close()

    def _acquire(self, token: str) -> StoreClient:
        with self._lock:
            client = self._take(token)
            if client is not None:
                self._holds[client] += 1
                return client
        built = StoreClient(self.endpoints, token, self.config)  # Describe: raises if unknown
        with self._lock:
            client = self._take(token)
            if client is None:
                client, built = built, None
                self._kept[token] = client
            self._holds[client] += 1
        if built is not None:
            built.close()  # another call built this token's client first
        return client

    def _take(self, token: str) -> StoreClient | None:
        """(Under the lock.) The token's client, now the most recently used."""
        client = self._kept.pop(token, None) or self._evicted.pop(token, None)
        if client is not None:
            self._kept[token] = client
        return client

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
                token, client = self._kept.popitem(last=False)
                self._evicted[token] = client
            idle = [t for t, c in self._evicted.items() if not self._busy(c, in_use)]
            closing = [self._evicted.pop(token) for token in idle]
        for client in closing:
            client.close()

    def _busy(self, client: StoreClient, in_use: set[StoreClient]) -> bool:
        return client in self._holds or client in in_use
