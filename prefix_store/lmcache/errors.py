"""The gateway's one error root. Store failures stay the store's typed `StoreError`s."""

from __future__ import annotations


class GatewayError(Exception):
    """The gateway cannot start or serve as configured (unknown token or namespace, a port
    it cannot bind); the message names the setting at fault, never the token."""


class ProtocolError(GatewayError):
    """A frame the gateway will not parse (bad command, length or key): its connection is
    closed, since nothing after it can be framed; other connections are unaffected."""
