"""The Decoder service: workers that generate over prefixes cached in the prefix store.

`DecoderWorker` (worker.py) owns a model and the request flow (lookup, artifact, suffix
prefill, draft/verify) over its `PrefixCache` (prefix_cache.py), `EnginePool`
(engine_pool.py) and `ModelThread` (model_thread.py); `DecoderServer` (server.py) serves it
over gRPC with health checking and reflection, converting protobufs to the worker's specs;
`DecoderClient` (client.py) is the SDK.
"""

from decoder.service.client import DecoderClient, GenerateReply
from decoder.service.config import DecoderConfig
from decoder.service.server import DecoderServer
from decoder.service.worker import DecoderWorker

__all__ = ["DecoderClient", "DecoderConfig", "DecoderServer", "DecoderWorker", "GenerateReply"]
