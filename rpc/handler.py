"""The auth-first handler every RPC of every service is served by (`unary`, `streaming`).

A call is let in by its service's `Gate`, in this order: its bearer token is read from
the metadata and authenticated (a caller without a known token gets UNAUTHENTICATED
whatever it sends, before any byte of its request is read), one of the caller's call slots
is taken (held until the call, a stream included, ends), and only then is its request
read and served. Every call is counted by method and final status (`RpcMetrics`), and a
failure ends it with its status from the service's `StatusMap`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from prefix_store.auth import bearer_token
from rpc.metrics import RpcMetrics
from rpc.server import parse, peer_host
from rpc.status import StatusMap


class Call:
    """One call as its handler sees it: the gRPC context (its attributes read through),
    the caller's bearer token and whom it authenticated as."""

    def __init__(self, context: grpc.ServicerContext, token: str, caller: Any) -> None:
        self.context = context
        self.token = token
        self.caller = caller
        """What the service's `Gate.authenticate` gave for the token (a tenant, a client)."""

    def __getattr__(self, name: str):
        return getattr(self.context, name)


@dataclass(frozen=True, slots=True)
class Gate:
    """How a service lets its calls in and ends the failed ones."""

    service: str
    """The service's short name: a failure is logged as `service.Method`."""
    metrics: RpcMetrics
    """Counts every call by method and final status."""
    status: StatusMap
    """The status each failure ends its call with."""
    authenticate: Callable[[str, str], AbstractContextManager[Any]]
    """(token, the caller's address) -> the caller, held until the call ends; raises
    Unauthenticated for an unknown token (LimitExceeded when the address is throttled)."""
    admit: Callable[[Any], AbstractContextManager[Any]]
    """The caller -> one of its call slots (LimitExceeded when it holds its share)."""
    read: Callable[[str, Any, Call], Any]
    """(method, its raw request, the call) -> the request its handler is given."""

    @contextmanager
    def enter(self, context: grpc.ServicerContext) -> Iterator[Call]:
        """The call, authenticated and holding a call slot, for the block's duration."""
        token = bearer_token(context.invocation_metadata())
        with self.authenticate(token, peer_host(context.peer())) as caller, self.admit(caller):
            yield Call(context, token, caller)


def unary(method):
    """A handler with one response: `method(self, request, call)`, let in by `self.gate`."""

    @functools.wraps(method)
    def handler(self, raw, context):
        gate, name = self.gate, method.__name__
        try:
            with gate.metrics.call(name, gate.status.code_of), gate.enter(context) as call:
                return method(self, gate.read(name, raw, call), call)
        except Exception as error:  # noqa: BLE001 - every failure gets a precise status
            gate.status.abort(context, error, f"{gate.service}.{name}")

    return handler


def streaming(method):
    """A handler with a response stream: as `unary`, the slot held until the stream ends."""

    @functools.wraps(method)
    def handler(self, raw, context):
        gate, name = self.gate, method.__name__
        try:
            with gate.metrics.call(name, gate.status.code_of), gate.enter(context) as call:
                yield from method(self, gate.read(name, raw, call), call)
        except Exception as error:  # noqa: BLE001 - every failure gets a precise status
            gate.status.abort(context, error, f"{gate.service}.{name}")

    return handler


def parsed(requests: dict[str, Any]) -> Callable[[str, Any, Call], Any]:
    """A `Gate.read` that parses each method's raw request as its message in `requests`."""
    return lambda method, raw, call: parse(requests[method], raw)


def as_sent(method: str, raw: Any, call: Call) -> Any:
    """A `Gate.read` that hands the raw request on (a handler that forwards it)."""
    return raw


def serialize(message) -> bytes:
    """A response message as the wire carries it."""
    return message.SerializeToString()
