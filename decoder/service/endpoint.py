"""The Decoder service's gRPC surface, which decoders and routers serve alike: its name, its
method table and the server that binds it. It needs no model runtime, so a router imports
it without loading torch."""

from __future__ import annotations

from typing import Protocol

import grpc

from rpc.handler import serialize
from rpc.server import grpc_server

SERVICE = "vericache.v1.Decoder"


class DecoderMethods(Protocol):
    """What serves the methods: `DecoderServicer` (a decoder) or a router's servicer. Each
    takes its request as raw bytes (it authenticates before it parses)."""

    def Generate(self, request: bytes, context: grpc.ServicerContext): ...  # noqa: N802

    def Publish(self, request: bytes, context: grpc.ServicerContext): ...  # noqa: N802

    def Info(self, request: bytes, context: grpc.ServicerContext): ...  # noqa: N802


def handlers(servicer: DecoderMethods) -> grpc.GenericRpcHandler:
    """The service's method table, as the generated `add_DecoderServicer_to_server` builds
    it, except that requests stay bytes: each handler authenticates before it parses."""
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                servicer.Generate, response_serializer=serialize
            ),
            "Publish": grpc.unary_unary_rpc_method_handler(
                servicer.Publish, response_serializer=serialize
            ),
            "Info": grpc.unary_unary_rpc_method_handler(
                servicer.Info, response_serializer=serialize
            ),
        },
    )


def decoder_service(servicer: DecoderMethods, workers: int, host: str, port: int, tls, name: str):
    """A gRPC server serving the Decoder service with `servicer`, health checking and
    reflection, bound to host:port (TLS when `tls`); (server, the port bound)."""
    options = [("grpc.max_receive_message_length", 64 << 20)]
    return grpc_server(
        handlers(servicer), SERVICE, f"{host}:{port}", tls, workers=workers, name=name,
        options=options,
    )  # fmt: skip
