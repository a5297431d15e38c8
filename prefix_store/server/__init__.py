"""The shard's gRPC server, by noun: `service` (what every part shares: the shard, the
gate its calls come in by, request checks), `requests` (what each method's request may be),
its parts `chunks`, `artifacts`, `attend` and `admin`, `transfers` (the data plane's side
of a put or fetch ticket), and `app` (the method table, the server and `ShardServer`)."""

from prefix_store.server.app import ShardServer, create_server, handlers, server_options
from prefix_store.server.requests import REQUESTS, STREAMS
from prefix_store.server.service import Service

__all__ = [
    "REQUESTS",
    "STREAMS",
    "Service",
    "ShardServer",
    "create_server",
    "handlers",
    "server_options",
]
