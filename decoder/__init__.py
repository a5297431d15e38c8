"""The decoder: model runner (exact and fast modes), KV caches, compressors, the
draft/verify engine and generation.

Public surface (imported lazily so that light users, such as the CLI's argument parsing,
do not pay for importing torch):
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# Exact mode needs matrix kernels whose per-row results do not depend on how many rows are
# computed together (numerics.cpu.forward; proved at start-up by decoder.selfcheck). oneDNN's
# AVX-512 fp32 kernels (found on AMD EPYC with AVX-512) block rows differently by row
# count, so a token's logits changed with its batch; its AVX2 kernels do not. oneDNN reads
# this once, at its first primitive, so it is set before anything in the decoder runs (an
# operator may override it; the self-check still decides whether exact mode holds).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

_EXPORTS = {
    "ModelConfig": "decoder.config",
    "RunnerConfig": "decoder.config",
    "ModelRunner": "decoder.runner",
    "SeqInput": "decoder.runner",
    "KVCache": "decoder.kv_cache",
    "LoadedModel": "decoder.loader",
    "load_model": "decoder.loader",
    "BUILTIN_MODEL": "decoder.loader",
    "generate_full": "decoder.generate",
    "GenerationResult": "decoder.generate",
    "Engine": "decoder.engine",
    "EngineConfig": "decoder.engine",
    "Request": "decoder.engine",
    "Prefix": "decoder.engine",
    "prefill_prefix": "decoder.engine",
    "SamplingParams": "decoder.sampling",
    "FullKVSource": "decoder.kv_source",
    "LocalKVSource": "decoder.kv_source",
    "parse_compressor": "decoder.compressors",
    "DecoderError": "decoder.errors",
    "ModelLoadError": "decoder.errors",
    "ExactModeUnsupported": "decoder.errors",
    "CompressorSpecError": "decoder.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'decoder' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
