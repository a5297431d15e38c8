"""Shared namespaces: their members and roles (owner, writer, reader)."""

from __future__ import annotations

import secrets

from prefix_store.errors import InvalidArgument
from prefix_store.metadata.records import RedisPlane, check_name, role_of


class SharedNamespaces(RedisPlane):
    """Needs `_require_tenant` (`Tenants`): only existing tenants become members."""

    def add_shared(
        self,
        namespace: str,
        members: list[str],
        readers: list[str] = (),
        owner: str | None = None,
    ) -> None:
        """Create (or extend) a shared namespace: `members` may read and write (publish),
        `readers` only read, `owner` (a member) may also delete what others stored."""
        check_name("namespace", namespace)
        for member in [*members, *readers, *([owner] if owner else [])]:
            self._require_tenant(member)
        writers = [*members, *([owner] if owner else [])]

        def write():
            key = f"{self.p}:ns:{namespace}"
            self.redis.hsetnx(key, "salt", secrets.token_hex(16))
            self.redis.sadd(f"{self.p}:namespaces", namespace)
            if owner:
                self.redis.hset(key, "owner", owner)
            if writers:
                self.redis.sadd(f"{key}:members", *writers)
                self.redis.srem(f"{key}:readers", *writers)
            if readers:
                self.redis.sadd(f"{key}:members", *readers)
                self.redis.sadd(f"{key}:readers", *readers)

        self._call(write)

    def remove_member(self, namespace: str, member: str) -> None:
        """Take `member` out of a shared namespace (effective within servers' cache time)."""
        check_name("namespace", namespace)
        if not self._call(self.redis.sismember, f"{self.p}:ns:{namespace}:members", member):
            raise InvalidArgument(f"tenant {member!r} is not a member of {namespace!r}")
        self._call(self._drop_member, namespace, member)

    def _drop_member(self, namespace: str, member: str) -> None:
        key = f"{self.p}:ns:{namespace}"
        pipe = self.redis.pipeline()
        pipe.srem(f"{key}:members", member)
        pipe.srem(f"{key}:readers", member)
        pipe.execute()
        if self.redis.hget(key, "owner") == member.encode():
            self.redis.hdel(key, "owner")

    def shared_namespaces(self) -> dict[str, list[str]]:
        def read():
            names = sorted(n.decode() for n in self.redis.smembers(f"{self.p}:namespaces"))
            return {
                n: sorted(m.decode() for m in self.redis.smembers(f"{self.p}:ns:{n}:members"))
                for n in names
            }

        return self._call(read)

    def roles(self, namespace: str) -> dict[str, str]:
        """Each member of a shared namespace and its role (owner, writer or reader)."""

        def read():
            key = f"{self.p}:ns:{namespace}"
            members = self.redis.smembers(f"{key}:members")
            readers = self.redis.smembers(f"{key}:readers")
            owner = self.redis.hget(key, "owner")
            return {m.decode(): role_of(m, owner, readers) for m in sorted(members)}

        return self._call(read)
