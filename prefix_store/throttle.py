"""A fixed, small cost per unknown token: each peer may fail authentication only so often.

Checking a token the server does not already know costs it I/O (a Redis GET on a shard, a
Describe on a decoder or router). A bounded negative cache would not cap that cost, since
random distinct tokens never repeat; so every peer (an IPv4 address, an IPv6 /64) has a
token bucket of failed authentications instead: `burst` at once, then `per_s` a second.
A check of a token the server does not know takes one token from the peer's bucket before
its I/O starts, and gives it back if the token turns out known (or the check could not be
made); an empty bucket refuses the check before any I/O, RESOURCE_EXHAUSTED naming the
limit. Tokens the server knows (cached) are never throttled, so a busy client behind the
same address keeps working. Existing tokens stay valid: nothing about their format changes.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from prefix_store.errors import LimitExceeded


@dataclass(frozen=True, slots=True)
class AuthBounds:
    """How much authentication may cost a server."""

    cache_s: float = 2.0
    """A known token's answer is reused this long: a rotated or removed token is refused
    within it."""
    known_tokens: int = 10_000
    """Known tokens remembered (least recently used dropped first); a remembered token is
    re-checked after `cache_s` without being throttled."""
    failures_burst: int = 64
    """Unknown tokens one peer may try at once before it is throttled."""
    failures_per_s: float = 4.0
    """Unknown tokens one peer may try per second once its burst is spent."""
    peers: int = 4096
    """Peers whose failures are tracked (least recently seen forgotten first)."""

    def __post_init__(self) -> None:
        if self.cache_s < 0:
            raise ValueError("AuthBounds.cache_s must be >= 0")
        if self.failures_burst < 1 or self.failures_per_s <= 0:
            raise ValueError("AuthBounds: failures_burst must be >= 1, failures_per_s > 0")
        if self.known_tokens < 1 or self.peers < 1:
            raise ValueError("AuthBounds: known_tokens and peers must be >= 1")


def peer_key(host: str) -> str:
    """The bucket a peer's address falls in: the address itself, an IPv6 address's /64
    (one host may hold a whole /64), or "" for a peer without an IP address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 6 and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address.ipv4_mapped or address) if address.version == 6 else str(address)


class FailureThrottle:
    """Per-peer token buckets of failed authentications (bounded, LRU). Thread-safe."""

    def __init__(self, bounds: AuthBounds, clock=time.monotonic) -> None:
        self.bounds = bounds
        self.clock = clock
        self.refused = 0
        """Checks refused before any I/O (a metric)."""
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # (level, at)
        self._lock = threading.Lock()

    def take(self, host: str) -> str:
        """Take one failure from `host`'s bucket before checking an unknown token: its key,
        to `refund` when the token is known. LimitExceeded when the bucket is empty."""
        key = peer_key(host)
        with self._lock:
            level = self._level(key)
            if level < 1:
                self.refused += 1
                wait = (1 - level) / self.bounds.failures_per_s
                raise LimitExceeded(
                    f"authorization: too many unknown tokens from this peer (at most "
                    f"{self.bounds.failures_burst} at once, then {self.bounds.failures_per_s:g} "
                    f"per second); retry in {wait:.1f} s"
                )
            self._store(key, level - 1)
        return key

    def refund(self, key: str) -> None:
        """The token taken for turned out known (or was not checked): give it back."""
        with self._lock:
            self._store(key, min(self.bounds.failures_burst, self._level(key) + 1))

    def _level(self, key: str) -> float:
        """(Under the lock.) The bucket's level now."""
        level, at = self._buckets.get(key, (self.bounds.failures_burst, self.clock()))
        refill = (self.clock() - at) * self.bounds.failures_per_s
        return min(self.bounds.failures_burst, level + refill)

    def _store(self, key: str, level: float) -> None:
        self._buckets[key] = (level, self.clock())
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.bounds.peers:
            self._buckets.popitem(last=False)
