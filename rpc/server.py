"""Building a gRPC server, and what every handler does with a raw request.

`grpc_server` is the one server builder: one generic handler for the service, bounded
health checking (`rpc.health`) and reflection of the service, health and reflection
itself, bound to host:port (TLS when given). Handlers receive raw bytes (their size is
checked before parsing) and parse them with `parse`."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefix_store.errors import Aborted, InvalidArgument
from prefix_store.tls import TLSConfig, bind
from rpc.health import HealthServicer


def grpc_server(
    handler: grpc.GenericRpcHandler,
    service: str,
    address: str,
    tls: TLSConfig | None,
    *,
    workers: int,
    name: str,
    options: Sequence[tuple[str, int]] = (),
) -> tuple[grpc.Server, int]:
    """A server of `handler` (the service named `service`, its full proto name), health
    checking and reflection, with `workers` handler threads (named `name`-N), bound to
    `address` (host:port; port 0 = a free one); (server, the port bound). OSError when it
    cannot bind."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name),
        options=list(options),
    )
    server.add_generic_rpc_handlers((handler,))
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer((service, "")), server)
    names = (service, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = bind(server, address, tls)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return server, port


def parse(message_class, raw: bytes):
    """`raw` as a `message_class`; InvalidArgument naming the message when it is malformed."""
    try:
        return message_class.FromString(raw)
    except DecodeError as error:
        raise InvalidArgument(f"{message_class.__name__}: malformed message ({error})") from error


def client_stream(requests):
    """The client's messages; a client that goes away mid-stream ends the RPC as ABORTED."""
    try:
        yield from requests
    except grpc.RpcError as error:
        raise Aborted("the client went away mid-stream; nothing was stored") from error


def peer_host(peer: str) -> str:
    """The address of a gRPC peer ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000"), as the data
    plane sees the same client; "" when it is not an IP peer (then any address may redeem)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]").removeprefix("::ffff:")
    return ""
