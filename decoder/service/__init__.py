"""The Decoder service: workers that generate over prefixes cached in the prefix store.

`DecoderWorker` (worker.py) owns a model and the request flow (lookup, artifact, suffix
prefill, draft/verify) over its `PrefixCache` (prefix_cache.py), `EnginePool`
(engine_pool.py) and `ModelThread` (model_thread.py); `DecoderServer` (server.py) serves it
over gRPC with health checking and reflection, converting protobufs to the worker's specs;
`DecoderClient` (client.py) is the SDK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decoder.service.client import DecoderClient, GenerateReply
    from decoder.service.config import DecoderConfig
    from decoder.service.server import DecoderServer
    from decoder.service.worker import DecoderWorker

__all__ = ["DecoderClient", "DecoderConfig", "DecoderServer", "DecoderWorker", "GenerateReply"]


def __getattr__(name: str):
    """Each name imported on first use: a process that only talks to decoders (the router,
    the SDK, the CLI) never loads the model runtime (torch) the server and worker need."""
    if name in ("DecoderClient", "GenerateReply"):
        from decoder.service import client as module
    elif name == "DecoderConfig":
        from decoder.service import config as module
    elif name == "DecoderServer":
        from decoder.service import server as module
    elif name == "DecoderWorker":
        from decoder.service import worker as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)
