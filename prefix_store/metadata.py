"""The metadata plane in Redis: shard membership, tenants, shared namespaces, usage.

Only small, soft state lives here; no KV bytes ever do. Shards re-write their membership
and usage on every heartbeat, so a restarted Redis is repopulated within one heartbeat.
Tenants and namespaces are durable only as far as Redis persists them (the embedded
Redis runs with an append-only file).

Keys (prefix "vc:"):
  vc:shard:<id>            JSON {address, ...stats}, expires after the shard's TTL
  vc:usage:<id>            hash tenant -> bytes stored on that shard, same TTL
  vc:tenant:<name>         hash {quota, salt, created, token (the token's sha256),
                           weight (its fair share's weight, default 1.0), admin (0|1)}
  vc:tenants               set of tenant names
  vc:token:<sha256>        tenant name
  vc:ns:<name>             hash {salt, owner} of a shared namespace
  vc:ns:<name>:members     set of tenant names (every role)
  vc:ns:<name>:readers     the members that may only read
  vc:config                hash {replication}
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import redis

from prefix_store.errors import InvalidArgument, Unavailable
from prefix_store.namespace import OWNER, READER, WRITER, Namespace
from prefix_store.shares import check_weight

log = logging.getLogger(__name__)
NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
DEFAULT_QUOTA = 8 << 30
"""Bytes a new tenant may store (replicas included) unless given another quota."""
SECRET_QUERY = re.compile(r"(?i)\b(password=)[^&]*")


def redact_url(url: str) -> str:
    """`url` with its password masked (user, host, port, path kept): what may be printed or
    logged. The one place the project redacts a Redis URL."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        host = f"{user}:***@{host}" if colon else f"***@{host}"
    query = SECRET_QUERY.sub(r"\1***", parts.query)
    return f"{parts.scheme}://{host}{parts.path}" + (f"?{query}" if query else "")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "vc_" + secrets.token_urlsafe(32)


def role_of(member: bytes, owner: bytes | None, readers: set[bytes]) -> str:
    if member == owner:
        return OWNER
    return READER if member in readers else WRITER


def check_name(kind: str, name: str) -> str:
    if not NAME.match(name):
        raise InvalidArgument(
            f"{kind} name {name!r}: use 1-63 of a-z 0-9 _ . - (starting with a letter or digit)"
        )
    return name


def valid_weight(weight: float) -> float:
    """`weight` as a tenant's share weight; InvalidArgument unless finite and > 0."""
    try:
        return check_weight(weight)
    except ValueError as error:
        raise InvalidArgument(str(error)) from error


def weight_of(raw: bytes | None) -> float:
    """A stored weight; a record without one (older) or a broken one weighs 1.0."""
    try:
        return check_weight(float(raw)) if raw else 1.0
    except ValueError:
        return 1.0


@dataclass(frozen=True, slots=True)
class ShardRecord:
    shard_id: str
    address: str
    info: dict


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    quota: int
    """Bytes the tenant may store (replicas included); 0 = unlimited."""
    namespaces: dict[str, Namespace]
    """What the tenant may use, by the name it writes: "" is its private namespace."""
    weight: float = 1.0
    """Its weight in every fair share of a server's bounds (`prefix_store.shares`): a
    tenant of weight 2 may hold twice what one of weight 1 holds when both are busy."""
    admin: bool = False
    """The admin role (operators' tooling): its calls take slots from a small pool that
    tenants cannot fill, before any of the shared ones."""


class Metadata:
    def __init__(self, url: str, prefix: str = "vc") -> None:
        self.url = url
        self.p = prefix
        self.redis = redis.Redis.from_url(
            url, socket_timeout=5, socket_connect_timeout=5, health_check_interval=10
        )

    def _call(self, fn, *args):
        """`fn(*args)`; a Redis failure is Unavailable, whose message (which callers of the
        store see, authenticated or not) says nothing of the URL: the log has the detail."""
        try:
            return fn(*args)
        except redis.RedisError as error:
            log.warning(
                "metadata plane (Redis at %s): %s", redact_url(self.url), self._redact(error)
            )
            raise Unavailable("metadata plane unreachable; try again later") from error

    def _redact(self, error: Exception) -> str:
        text, password = str(error), urlsplit(self.url).password
        for secret in {password, unquote(password)} if password else ():
            text = text.replace(secret, "***")
        return text

    def ping(self) -> bool:
        return bool(self._call(self.redis.ping))

    # ---- shards -------------------------------------------------------------------------

    def heartbeat(self, shard_id: str, address: str, info: dict, usage: dict, ttl_s: float):
        def write():
            pipe = self.redis.pipeline()
            ttl_ms = int(ttl_s * 1000)
            record = json.dumps({"address": address, **info})
            pipe.set(f"{self.p}:shard:{shard_id}", record, px=ttl_ms)
            pipe.delete(f"{self.p}:usage:{shard_id}")
            if usage:
                pipe.hset(f"{self.p}:usage:{shard_id}", mapping=usage)
                pipe.pexpire(f"{self.p}:usage:{shard_id}", ttl_ms)
            pipe.execute()

        self._call(write)

    def deregister(self, shard_id: str) -> None:
        self._call(self.redis.delete, f"{self.p}:shard:{shard_id}", f"{self.p}:usage:{shard_id}")

    def shards(self) -> list[ShardRecord]:
        def read():
            keys = sorted(self.redis.scan_iter(match=f"{self.p}:shard:*", count=1000))
            values = self.redis.mget(keys) if keys else []
            out = []
            for key, value in zip(keys, values, strict=True):
                if value is None:
                    continue
                info = json.loads(value)
                shard_id = key.decode().split(":", 2)[2]
                out.append(ShardRecord(shard_id, info.pop("address"), info))
            return out

        return self._call(read)

    def usage(self, exclude_shard: str | None = None) -> dict[str, int]:
        """Bytes per tenant over the live shards (optionally leaving one out)."""

        def read():
            total: dict[str, int] = {}
            for shard in self.shards():
                if shard.shard_id == exclude_shard:
                    continue
                for tenant, value in self.redis.hgetall(f"{self.p}:usage:{shard.shard_id}").items():
                    total[tenant.decode()] = total.get(tenant.decode(), 0) + int(value)
            return total

        return self._call(read)

    def replication(self) -> int:
        value = self._call(self.redis.hget, f"{self.p}:config", "replication")
        return int(value) if value else 0

    def set_replication(self, factor: int) -> None:
        self._call(self.redis.hset, f"{self.p}:config", "replication", int(factor))

    # ---- tenants and namespaces -----------------------------------------------------------

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

    def tenant_names(self) -> list[str]:
        return sorted(m.decode() for m in self._call(self.redis.smembers, f"{self.p}:tenants"))

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
