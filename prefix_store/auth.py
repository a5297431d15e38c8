"""Bearer-token authentication and namespace access, shared by every server of the system."""

from __future__ import annotations

import threading
import time

from prefix_store.errors import NotFound, Unauthenticated
from prefix_store.metadata import Metadata, Tenant
from prefix_store.namespace import Namespace
from prefix_store.shard import Allowance

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
    a stream of RPCs does not cost a Redis round trip each."""

    def __init__(self, metadata: Metadata, cache_s: float = 2.0) -> None:
        self.metadata = metadata
        self.cache_s = cache_s
        self._cache: dict[str, tuple[float, Tenant]] = {}
        self._lock = threading.Lock()

    def tenant(self, invocation_metadata) -> Tenant:
        token = bearer_token(invocation_metadata)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(token)
        if hit is not None and hit[0] > now:
            return hit[1]
        tenant = self.metadata.tenant_of_token(token)
        if tenant is None:
            raise Unauthenticated("authorization: unknown token")
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[token] = (now + self.cache_s, tenant)
        return tenant


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
