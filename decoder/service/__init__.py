"""The Decoder service: workers that generate over prefixes cached in the prefix store.

`DecoderWorker` (worker.py) owns a model and the request flow (lookup, artifact, suffix
prefill, draft/verify) over its `PrefixCache` (prefix_cache.py), `EnginePool`
(engine_pool.py) and `ModelThread` (model_thread.py); `DecoderServer` (server.py) serves it
over gRPC with health checking and reflection, converting protobufs to the worker's specs;
`DecoderClient` (client.py) is the SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decoder.service.client import DecoderClient, GenerateReply
    from decoder.service.config import DecoderConfig
    from decoder.service.server import DecoderServer
    from decoder.service.worker import DecoderWorker

_HOMES = {
    "DecoderClient": "decoder.service.client",
    "GenerateReply": "decoder.service.client",
    "DecoderConfig": "decoder.service.config",
    "DecoderServer": "decoder.service.server",
    "DecoderWorker": "decoder.service.worker",
}
"""Each name's module, imported on first use: a process that only talks to decoders (the
router, the SDK, the CLI) never loads the model runtime (torch) the server and worker need."""

__all__ = ["DecoderClient", "DecoderConfig", "DecoderServer", "DecoderWorker", "GenerateReply"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
