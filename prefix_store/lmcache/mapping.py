"""LMCache's chunk keys and `naive` KV layout, mapped to VeriCache's where they agree.

Keys. LMCache 0.5.6 (`ChunkedTokenDatabase`) keys chunk i of a token sequence by
h_i = H((h_{i-1}, tuple(tokens of chunk i), ())) from h_{-1} = NONE_HASH, with H its
`pre_caching_hash_algorithm`, in a `CacheEngineKey` string `model@world@worker@hex(h_i)@dtype`.
Given the engine's keying (`LMCacheKeying`: model name, world size, worker id, dtype, chunk
size, hash, NONE_HASH), `lmcache_keys` reproduces those strings from token ids, so the KV of
a token prefix that LMCache stored through the gateway can be found by its tokens. The
converse cannot be done: a chunk hash is one-way, so nothing maps an LMCache key to
VeriCache's chunk keys (seeded with the model's weight digest, the layout, the chunk size
and the namespace salt, and confirmed against stored tokens) without the tokens.

Layout. A `naive` object in KV_2LTD, [2, layers, tokens, kv_heads * head_dim], holds the
same values as VeriCache's chunk layout (layer-major, K then V, each [kv_heads, tokens,
head_dim]) in another order, when layers, KV heads, head dim and dtype agree; `naive_to_kv`
and `kv_to_naive` are exact permutations (bitwise).

Trust. LMCache's KV was computed by another engine (vLLM's kernels, its batching, its GPU),
so it is not bitwise what VeriCache's exact-mode runner computes, and nothing proves its
origin. `import_prefix` therefore publishes it *unsigned* into the gateway's namespace: a
decoder finds it by the usual chunk keys but never verifies against it, unless the tenant
opts in to its own unsigned KV in its private namespace (`use_unsigned_prefix`; DESIGN
section 8), where the output is exact only as far as that KV is. Nothing here signs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from prefix_store.client import PublishResult, StoreClient
from prefix_store.errors import InvalidArgument
from prefix_store.keys import sha256_cbor_64bit
from prefix_store.layout import KVLayout
from prefix_store.lmcache.objects import ObjectStore
from prefix_store.lmcache.protocol import FMT_KV_2LTD, ObjectMeta

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
from lmcache.utils import CacheEngineKey  # noqa: E402

DTYPE_CODES: dict[str, tuple[int, ...]] = {"float16": (1, 2), "bfloat16": (3,), "float32": (4,)}
"""LMCache's wire dtype codes (`DTYPE_TO_INT`) for VeriCache's dtypes (half has two)."""

HASHES = {"sha256_cbor_64bit": sha256_cbor_64bit, "sha256_cbor": sha256_cbor_64bit, "builtin": hash}
"""LMCache's chunk hashes that can be reproduced here. vLLM's `sha256_cbor` digests are
folded to their first 8 bytes by LMCache, which is `sha256_cbor_64bit`. `builtin` is
Python's hash() of int tuples: independent of PYTHONHASHSEED, but of the CPython version
(>= 3.8 agree) and word size (64-bit)."""


@dataclass(frozen=True, slots=True)
class LMCacheKeying:
    """How an LMCache engine names its chunks (its config and metadata)."""

    model_name: str
    """`LMCacheMetadata.model_name` (the served model name)."""
    dtype: Literal["float16", "bfloat16", "float32"]
    """The KV dtype (`LMCacheMetadata.kv_dtype`)."""
    chunk_size: int = 256
    """`LMCacheEngineConfig.chunk_size`."""
    world_size: int = 1
    """Tensor-parallel ranks; only 1 maps (each rank stores its own heads under its id)."""
    worker_id: int = 0
    hash_algorithm: Literal["sha256_cbor_64bit", "sha256_cbor", "builtin"] = "builtin"
    """`pre_caching_hash_algorithm` (LMCache's default is builtin)."""
    none_hash: int = 0
    """The chain's start: 0 without vLLM; with vLLM, its NONE_HASH (derived from
    PYTHONHASHSEED: random in every process when that is unset, and then nothing maps)."""
    save_unfull_chunk: bool = False
    """`LMCacheEngineConfig.save_unfull_chunk`: whether a last, partial chunk is stored."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPE_CODES)}")
        if self.world_size != 1:
            raise ValueError("world_size: only 1 maps (a rank's object holds its heads only)")
        if self.chunk_size < 1:
            raise ValueError("chunk_size: must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return KVLayout("k", self.dtype, 1, 1, 1).torch_dtype


def lmcache_keys(tokens: Sequence[int], keying: LMCacheKeying) -> list[str]:
    """LMCache's key strings for the chunks of `tokens` it stores (a partial last one only
    with `save_unfull_chunk`)."""
    hash_fn, prefix = HASHES[keying.hash_algorithm], keying.none_hash
    keys = []
    for start in range(0, len(tokens), keying.chunk_size):
        chunk = tuple(int(t) for t in tokens[start : start + keying.chunk_size])
        if len(chunk) < keying.chunk_size and not keying.save_unfull_chunk:
            break
        prefix = hash_fn((prefix, chunk, ()))
        key = CacheEngineKey(
            keying.model_name, keying.world_size, keying.worker_id, prefix, keying.torch_dtype
        )
        keys.append(key.to_string())
    return keys


def check_naive(meta: ObjectMeta, layout: KVLayout, nbytes: int | None = None) -> int:
    """The tokens of a naive KV_2LTD object of `layout`'s model (of `nbytes` payload bytes,
    when given); InvalidArgument naming what differs when its format, dtype, shape or size
    does not agree with the layout."""
    two, layers, tokens, hidden = meta.shape
    if meta.fmt != FMT_KV_2LTD:
        raise InvalidArgument(f"fmt: {meta.fmt} is not KV_2LTD ({FMT_KV_2LTD})")
    if meta.dtype not in DTYPE_CODES[layout.dtype]:
        raise InvalidArgument(f"dtype: LMCache code {meta.dtype} is not {layout.dtype}")
    if (two, layers, hidden) != (2, layout.num_layers, layout.num_kv_heads * layout.head_dim):
        raise InvalidArgument(f"shape: {meta.shape} is not [2, layers, tokens, heads * dim]")
    if tokens < 1:
        raise InvalidArgument("shape: no tokens")
    if nbytes is not None and nbytes != layout.chunk_bytes(tokens):
        raise InvalidArgument(
            f"payload: {nbytes} bytes, shape {meta.shape} has {layout.chunk_bytes(tokens)}"
        )
    return tokens


def naive_to_kv(payload, meta: ObjectMeta, layout: KVLayout) -> torch.Tensor:
    """A naive KV_2LTD object's values as VeriCache's [layers, 2, kv_heads, tokens,
    head_dim] (a copy, bitwise the same values)."""
    tokens = check_naive(meta, layout, memoryview(payload).nbytes)
    flat = torch.frombuffer(bytearray(payload), dtype=layout.torch_dtype)
    # [2, L, T, H, D] -> [L, 2, H, T, D]
    kv = flat.view(2, layout.num_layers, tokens, layout.num_kv_heads, layout.head_dim)
    return kv.permute(1, 0, 3, 2, 4).contiguous()


def kv_to_naive(kv: torch.Tensor) -> torch.Tensor:
    """VeriCache's [layers, 2, kv_heads, tokens, head_dim] as LMCache's KV_2LTD
    [2, layers, tokens, kv_heads * head_dim] (a copy)."""
    layers, _, heads, tokens, dim = kv.shape
    return kv.permute(1, 0, 3, 2, 4).reshape(2, layers, tokens, heads * dim).contiguous()


def find_prefix(
    objects: ObjectStore, tokens: Sequence[int], keying: LMCacheKeying, layout: KVLayout
) -> tuple[int, torch.Tensor | None]:
    """The longest prefix of `tokens` whose chunks LMCache stored (through a gateway on
    `objects`' namespace) in `layout`'s geometry: (its tokens, its KV [layers, 2, kv_heads,
    tokens, head_dim]), or (0, None). Stops at the first chunk missing or not agreeing."""
    parts, covered = [], 0
    for key in lmcache_keys(tokens, keying):
        found = objects.get(key)
        expected = min(keying.chunk_size, len(tokens) - covered)
        if found is None or not _agrees(found, layout, expected):
            break
        parts.append(naive_to_kv(found[1], found[0], layout))
        covered += expected
    if not parts:
        return 0, None
    return covered, torch.cat(parts, dim=3)


def _agrees(found: tuple[ObjectMeta, memoryview], layout: KVLayout, tokens: int) -> bool:
    try:
        return check_naive(found[0], layout, found[1].nbytes) == tokens
    except InvalidArgument:
        return False


def import_prefix(
    objects: ObjectStore,
    client: StoreClient,
    tokens: Sequence[int],
    keying: LMCacheKeying,
    layout: KVLayout,
) -> PublishResult | None:
    """Publish what `find_prefix` finds as VeriCache chunks of `layout`, unsigned, in the
    objects' namespace (see the module's note on trust); None when nothing was found."""
    covered, kv = find_prefix(objects, tokens, keying, layout)
    if kv is None:
        return None
    return client.publish_prefix(list(tokens[:covered]), kv, layout, objects.namespace)
