"""All model work on a prefix, in one place: prefill it, observe its last queries, recompute
it after the store failed, compress it, and read it out for publishing.

Every function runs the runner in exact mode (bitwise the KV any exact decoder computes for
the prefix), so a prefix prefilled here, recomputed here or read from the store is one and
the same KV. Callers that hold a budget reserve the bytes (`prefill_bytes`) around a call;
the functions themselves allocate only what they return.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from decoder.compressors import CompressedKV, CompressorPipeline
from decoder.config import ModelConfig
from decoder.engine.request import Prefix
from decoder.kv_cache import KVCache
from decoder.kv_source import FullKVSource, LocalKVSource
from decoder.runner import ModelRunner, SeqInput

FullKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, (k, v): [KVH, P, D] each."""


def prefill_bytes(model: ModelConfig, tokens: int) -> int:
    """Budget bytes of a prefix's full KV held here while it is prefilled or observed."""
    return tokens * model.kv_bytes_per_token


def prefill_prefix(
    runner: ModelRunner,
    tokens: Sequence[int],
    observe: int = 128,
    room: int = 0,
    cache: KVCache | None = None,
) -> Prefix:
    """Exact prefill of a prefix into host memory (into `cache` when given, else a new one
    with `room` tokens after it), keeping its last `observe` queries."""
    tokens = list(tokens)
    if cache is None:
        cache = runner.new_cache(capacity=len(tokens) + room)
    observed = None
    if tokens:
        seq = SeqInput.extend(cache, tokens, logits="none", observe=observe)
        runner.forward([seq], "exact")
        observed = seq.observed
    return Prefix(tokens, LocalKVSource(cache, len(tokens)), observed)


def split_prompt(
    runner: ModelRunner, prompt: Sequence[int], observe: int = 128
) -> tuple[Prefix, list[int]]:
    """An in-process prompt: everything but its last token becomes the cached prefix."""
    if not prompt:
        raise ValueError("every prompt needs at least one token")
    return prefill_prefix(runner, prompt[:-1], observe), list(prompt[-1:])


def recompute_prefix(
    runner: ModelRunner, tokens: Sequence[int], cache: KVCache | None
) -> LocalKVSource:
    """A prefix whose stored KV cannot be read, prefilled here again (into `cache`, or a
    new buffer of its length)."""
    source = prefill_prefix(runner, tokens, observe=0, cache=cache).source
    assert isinstance(source, LocalKVSource)
    return source


def observe(runner: ModelRunner, prefix: Prefix, window: int) -> list[torch.Tensor]:
    """The rotated queries of the prefix's last `window` tokens: their exact forward over the
    rest of the prefix's full KV (what its prefill would have observed)."""
    p = prefix.source.length
    w = min(window, p)
    c = runner.config
    cache = runner.new_cache(capacity=p)
    k = torch.empty(c.num_kv_heads, p, c.head_dim)
    v = torch.empty(c.num_kv_heads, p, c.head_dim)
    for index, layer in enumerate(cache.layers):
        prefix.source.read_layer(index, k, v)
        layer.append(k[:, : p - w], v[:, : p - w], torch.arange(p - w))
    seq = SeqInput.extend(cache, prefix.tokens[p - w :], logits="none", observe=w)
    runner.forward([seq], "exact")
    return seq.observed


def read_full_kv(source: FullKVSource, model: ModelConfig) -> FullKV:
    """The prefix's full KV, layer by layer (what Publish stores)."""
    shape = (model.num_kv_heads, source.length, model.head_dim)
    kv = []
    for index in range(model.num_layers):
        k, v = torch.empty(shape), torch.empty(shape)
        source.read_layer(index, k, v)
        kv.append((k, v))
    return kv


def compress(pipeline: CompressorPipeline, prefix: Prefix, model: ModelConfig) -> CompressedKV:
    """The prefix's compressed KV from what its prefill observed (the one compression)."""
    return pipeline.compress(
        prefix.source, prefix.observed, model.num_layers, model.num_kv_heads, model.head_dim
    )


def compress_observing(
    runner: ModelRunner,
    pipeline: CompressorPipeline,
    prefix: Prefix,
    held: Callable[[int], AbstractContextManager] = lambda nbytes: nullcontext(),
) -> CompressedKV:
    """`compress`, observing the compressor's window again first when the prefill's
    observation does not cover it (its transient full KV `held(bytes)` meanwhile)."""
    if not pipeline.observes_enough(prefix.observed, prefix.source.length):
        with held(prefill_bytes(runner.config, prefix.source.length)):
            observed = observe(runner, prefix, pipeline.observe_window)
        prefix = Prefix(prefix.tokens, prefix.source, observed)
    return compress(pipeline, prefix, runner.config)


def compressed(pipeline: CompressorPipeline, prefix: Prefix, model: ModelConfig) -> CompressedKV:
    """The prefix's compressed KV for the pipeline's spec, built once per prefix (kept in
    `prefix.artifacts`)."""
    if pipeline.spec not in prefix.artifacts:
        prefix.artifacts[pipeline.spec] = compress(pipeline, prefix, model)
    return prefix.artifacts[pipeline.spec]
