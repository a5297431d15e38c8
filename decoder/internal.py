"""The deployment's internal credential: what its routers present to its decoders to read
their load (Info), since a router holds no tenant's token.

One random secret per deployment (`vci_` and 43 URL-safe characters; tenants' tokens
start `vc_`), kept in `<state dir>/internal.token` (0600) beside the provenance key:
`vericache node start --head` and `vericache serve` make it when absent, `ray up` copies it
to every host, and decoders and routers read it on their own host when they start, so it
is never an actor argument. It is never logged nor put in an error message.

A decoder accepts it for `INTERNAL_METHODS` only (Info), compared in constant time; with
any other method it is PERMISSION_DENIED, and it is never sent to the store, so it is no
tenant's token and reads or writes no tenant's data. A token that is not it is a tenant's
token or UNAUTHENTICATED, as before.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from prefix_store.errors import PermissionDenied

INTERNAL_METHODS = frozenset({"Info"})
"""Decoder methods the internal credential may call: what a router reads of a decoder."""
CALLER = "(deployment)"
"""Whose call slots its calls take (the admin pool first): no tenant can have this name."""
PREFIX = "vci_"


class InternalCaller:
    """Who presented the internal credential: the deployment itself (a router)."""

    def __repr__(self) -> str:
        return "INTERNAL"


INTERNAL = InternalCaller()
"""The caller a decoder's authentication gives for the internal credential (no store client)."""


def check_method(caller: object, method: str) -> None:
    """PermissionDenied when the internal caller calls a method it may not (before its
    request is read); any other caller passes."""
    if caller is INTERNAL and method not in INTERNAL_METHODS:
        raise PermissionDenied(f"the deployment's internal credential may not call {method}")


class InternalCredential:
    """The deployment's internal secret; its `repr` shows no byte of it."""

    def __init__(self, secret: str) -> None:
        if not secret.startswith(PREFIX) or len(secret) < len(PREFIX) + 32:
            raise ValueError(f"internal credential: expected {PREFIX} and 32+ characters")
        self._secret = secret.encode()

    def __repr__(self) -> str:
        return "InternalCredential(...)"

    @classmethod
    def generate(cls) -> InternalCredential:
        return cls(PREFIX + secrets.token_urlsafe(32))

    def matches(self, token: str) -> bool:
        """Whether `token` is this credential (constant time in the token's content)."""
        return hmac.compare_digest(token.encode(), self._secret)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC call metadata presenting it."""
        return (("authorization", f"Bearer {self._secret.decode()}"),)


def read_credential(path: Path) -> InternalCredential:
    """The deployment's internal credential from `path` on this host; a clear error when
    it is missing (`ray up` copies it from the head) or readable by others than its owner."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"internal credential {path} missing on this host: copy the head's "
            "(`ray up` does, with cluster_synced_files)"
        )
    if path.stat().st_mode & 0o077:
        raise PermissionError(f"internal credential {path} is readable by others: chmod 600 it")
    return InternalCredential(path.read_text().strip())


def load_or_create_credential(path: Path) -> InternalCredential:
    """The credential at `path`, made (0600) when absent."""
    path = Path(path)
    if path.exists():
        return read_credential(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    credential = InternalCredential.generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(credential._secret.decode() + "\n")
    return credential
