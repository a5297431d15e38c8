"""Bearer-token authentication and namespace access, shared by every server of the system."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from prefix_store.errors import NotFound, Unauthenticated
from prefix_store.metadata import Metadata
from prefix_store.metadata.records import Tenant
from prefix_store.namespace import Namespace
from prefix_store.shard import Allowance
from prefix_store.throttle import AuthBounds, FailureThrottle

BEARER = "bearer "


def bearer_token(invocation_metadata) -> str:
    """The token of `authorization: Bearer <token>`, or Unauthenticated."""
    for key, value in invocation_metadata or ():
        if key == "authorization":
            if not value.lower().startswith(BEARER) or not value[len(BEARER) :].strip():
                raise Unauthenticated("authorization: expected 'Bearer <token>'")
            return value[len(BEARER) :].strip()
    raise Unauthenticated("authorization: missing bearer token metadata")


def namespace_of(tenant: Tenant, name: str) -> Namespace:
    """The namespace `name` as `tenant` may use it. A namespace it may not use is reported
    exactly as one that does not exist."""
    space = tenant.namespaces.get(name)
    if space is None:
        raise NotFound(f"namespace {name!r} not found")
    return space


class Authenticator:
    """Maps tokens to tenants through the metadata plane, caching answers briefly so that
    a stream of RPCs does not cost a Redis round trip each.

    A token it does not know costs a Redis GET only while the caller's peer has failures
    left (`throttle.FailureThrottle`): beyond that it is refused with no I/O at all. A
    remembered token whose answer is older than `cache_s` is asked about again, unthrottled
    (a rotation or removal takes effect within `cache_s`)."""

    def __init__(self, metadata: Metadata, bounds: AuthBounds | None = None) -> None:
        self.metadata = metadata
        self.bounds = bounds or AuthBounds()
        self.throttle = FailureThrottle(self.bounds)
        self._known: OrderedDict[str, tuple[float, Tenant]] = OrderedDict()  # token: (until, .)
        self._lock = threading.Lock()

    def tenant(self, token: str, peer: str = "") -> Tenant:
        """The tenant of a caller's bearer token; `peer` is its address (`rpc.server.peer_host`),
        whose failed authentications are throttled. Unauthenticated, or LimitExceeded when
        throttled."""
        with self._lock:
            hit = self._known.get(token)
            if hit is not None:
                self._known.move_to_end(token)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        key = None if hit is not None else self.throttle.take(peer)  # before any I/O
        try:
            tenant = self.metadata.tenant_of_token(token)
        except BaseException:
            if key is not None:
                self.throttle.refund(key)  # not a failure of the caller's: no answer
            raise
        if tenant is None:
            self._forget(token)
            raise Unauthenticated("authorization: unknown token")
        if key is not None:
            self.throttle.refund(key)
        self._remember(token, tenant)
        return tenant

    def _remember(self, token: str, tenant: Tenant) -> None:
        with self._lock:
            self._known[token] = (time.monotonic() + self.bounds.cache_s, tenant)
            self._known.move_to_end(token)
            while len(self._known) > self.bounds.known_tokens:
                self._known.popitem(last=False)

    def _forget(self, token: str) -> None:
        with self._lock:
            self._known.pop(token, None)


class QuotaGuard:
    """quota(owner) for one shard: the owner's quota and its usage on the other live shards
    (from their heartbeats); the shard adds its own, exact usage under its lock."""

    def __init__(self, metadata: Metadata, shard_id: str) -> None:
        self.metadata = metadata
        self.shard_id = shard_id

    def __call__(self, owner: str) -> Allowance | None:
        tenant = self.metadata.tenant(owner)
        if tenant is None or tenant.quota == 0:
            return None
        elsewhere = self.metadata.usage(exclude_shard=self.shard_id).get(owner, 0)
        return Allowance(tenant.quota, elsewhere)
