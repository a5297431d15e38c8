"""What the metadata plane stores and how: names, tokens, records, and `RedisPlane`, the
one connection every part of `Metadata` calls Redis through."""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
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


def redact_error(error: Exception, url: str) -> str:
    """A Redis error's text with the URL's password masked (what may be logged)."""
    text, password = str(error), urlsplit(url).password
    for secret in {password, unquote(password)} if password else ():
        text = text.replace(secret, "***")
    return text


class RedisPlane:
    """The connection to the metadata plane's Redis (key prefix `p`): every read and write
    goes through `_call`, which turns a Redis failure into `Unavailable`."""

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
                "metadata plane (Redis at %s): %s",
                redact_url(self.url),
                redact_error(error, self.url),
            )
            raise Unavailable("metadata plane unreachable; try again later") from error

    def ping(self) -> bool:
        return bool(self._call(self.redis.ping))
