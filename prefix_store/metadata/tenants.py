"""Tenants: their records, bearer tokens (stored only as digests) and rotation, and what a
token resolves to (the tenant with every namespace it may use)."""

from __future__ import annotations

import secrets
import time

from prefix_store.errors import InvalidArgument
from prefix_store.metadata.records import (
    DEFAULT_QUOTA,
    RedisPlane,
    Tenant,
    check_name,
    new_token,
    role_of,
    token_digest,
    valid_weight,
    weight_of,
)
from prefix_store.namespace import Namespace


class Tenants(RedisPlane):
    """Needs `_drop_member` (`SharedNamespaces`): removing a tenant ends its memberships."""

    def add_tenant(
        self, name: str, quota: int = DEFAULT_QUOTA, weight: float = 1.0, admin: bool = False
    ) -> str:
        """Create a tenant; returns its bearer token (shown once, stored only hashed).
        `weight`: its weight in servers' fair shares (finite, > 0); `admin`: the admin role."""
        check_name("tenant", name)
        if quota < 0:
            raise InvalidArgument("quota: must be >= 0 bytes (0 = unlimited)")
        weight = valid_weight(weight)
        token = new_token()

        def write():
            if not self.redis.sadd(f"{self.p}:tenants", name):
                raise InvalidArgument(f"tenant {name!r} already exists")
            self.redis.hset(
                f"{self.p}:tenant:{name}",
                mapping={
                    "quota": quota,
                    "salt": secrets.token_hex(16),
                    "created": time.time(),
                    "token": token_digest(token),
                    "weight": repr(weight),
                    "admin": int(admin),
                },
            )
            self.redis.set(f"{self.p}:token:{token_digest(token)}", name)

        self._call(write)
        return token

    def rotate_token(self, name: str) -> str:
        """A new bearer token for `name`; the old one stops working at once (servers that
        cached it: within their cache time, a few seconds)."""
        self._require_tenant(name)
        token = new_token()

        def write():
            old = self._token_digests(name)
            pipe = self.redis.pipeline()
            for digest in old:
                pipe.delete(f"{self.p}:token:{digest}")
            pipe.set(f"{self.p}:token:{token_digest(token)}", name)
            pipe.hset(f"{self.p}:tenant:{name}", "token", token_digest(token))
            pipe.execute()

        self._call(write)
        return token

    def remove_tenant(self, name: str) -> None:
        """Delete a tenant: its token, its record and its memberships. What it stored stays
        until evicted (its private namespace is unreachable from then on)."""
        self._require_tenant(name)

        def write():
            old = self._token_digests(name)
            pipe = self.redis.pipeline()
            for digest in old:
                pipe.delete(f"{self.p}:token:{digest}")
            pipe.delete(f"{self.p}:tenant:{name}")
            pipe.srem(f"{self.p}:tenants", name)
            pipe.execute()
            for namespace in self.redis.smembers(f"{self.p}:namespaces"):
                self._drop_member(namespace.decode(), name)

        self._call(write)

    def _token_digests(self, name: str) -> list[str]:
        """The token digests naming `name` (the recorded one; a scan for older records)."""
        recorded = self.redis.hget(f"{self.p}:tenant:{name}", "token")
        if recorded:
            return [recorded.decode()]
        return [
            key.decode().rsplit(":", 1)[1]
            for key in self.redis.scan_iter(match=f"{self.p}:token:*", count=1000)
            if self.redis.get(key) == name.encode()
        ]

    def _require_tenant(self, name: str) -> None:
        if not self._call(self.redis.sismember, f"{self.p}:tenants", name):
            raise InvalidArgument(f"tenant {name!r} does not exist")

    def tenant_names(self) -> list[str]:
        return sorted(m.decode() for m in self._call(self.redis.smembers, f"{self.p}:tenants"))

    def tenant(self, name: str) -> Tenant | None:
        def read():
            fields = self.redis.hgetall(f"{self.p}:tenant:{name}")
            if not fields:
                return None
            spaces = {"": Namespace(f"tenant:{name}", "", bytes.fromhex(fields[b"salt"].decode()))}
            for shared in self.redis.smembers(f"{self.p}:namespaces"):
                shared = shared.decode()
                key = f"{self.p}:ns:{shared}"
                if self.redis.sismember(f"{key}:members", name):
                    salt, owner = self.redis.hmget(key, "salt", "owner")
                    readers = self.redis.smembers(f"{key}:readers")
                    spaces[shared] = Namespace(
                        f"shared:{shared}",
                        shared,
                        bytes.fromhex(salt.decode()),
                        role_of(name.encode(), owner, readers),
                    )
            return Tenant(
                name,
                int(fields[b"quota"]),
                spaces,
                weight_of(fields.get(b"weight")),
                fields.get(b"admin") == b"1",
            )

        return self._call(read)

    def tenant_of_token(self, token: str) -> Tenant | None:
        name = self._call(self.redis.get, f"{self.p}:token:{token_digest(token)}")
        return self.tenant(name.decode()) if name else None
