"""The full prefix KV in the remote prefix store, as a `FullKVSource`.

The engine reads a prefix one layer at a time (`read_layer`); here each read streams that
layer of every chunk from the shards holding it (data plane, failover to replicas) straight
into the caller's staging buffer. The engine cannot tell it from host memory: the tokens it
emits are the same (tests/decoder/test_store_source.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoder.config import ModelConfig
from decoder.kv_source import FullKVSource
from decoder.near_data import NearData
from numerics.cpu.forward import exact_kernel_id
from prefix_store.client import CachedPrefix, StoreClient
from prefix_store.client.near_data import full_chunks, kernels_match
from prefix_store.layout import KVLayout


def kv_layout(config: ModelConfig, model_id: str, dtype: str = "float32") -> KVLayout:
    """The store layout of a model's exact KV as this process computes it.

    The layout's model id is `model_id` (the weights' fingerprint) joined with the exact
    attention kernel this process runs (`exact_kernel_id`): KV computed by another kernel is
    not bitwise the same, so a decoder with a different kernel derives other chunk keys and
    sees a miss, never KV it cannot verify against.
    """
    identity = f"{model_id}+{exact_kernel_id(config.head_dim)}"
    return KVLayout(identity, dtype, config.num_layers, config.num_kv_heads, config.head_dim)


class StoreKVSource:
    """A cached prefix's full KV in the store, read layer by layer over the network."""

    def __init__(self, client: StoreClient, prefix: CachedPrefix) -> None:
        if prefix.tokens == 0:
            raise ValueError("the prefix is not cached: nothing to read")
        self.client = client
        self.prefix = prefix
        self.bytes_read = 0
        self.near_refused = ""
        """Why `near_data` declined, if it did."""

    @property
    def length(self) -> int:
        return self.prefix.tokens

    @property
    def nbytes(self) -> int:
        return self.prefix.bytes

    def read_layer(self, index: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Stream layer `index` into k_out, v_out ([KVH, length, D]); raises on failure."""
        self.bytes_read += self.client.fetch_layers(
            self.prefix, k_out.unsqueeze(0), v_out.unsqueeze(0), index, index + 1
        )

    def near_data(self, heads: int) -> NearData | None:
        """Near-data attention of this prefix for a model with `heads` query heads, when
        this process runs the fused kernel and every shard holding the prefix's full chunks
        advertises its fingerprint (else None: passes pull, and `near_refused` says why)."""
        near = NearData(self.client, self.prefix, self, heads)
        chunks = full_chunks(self.prefix)
        if not near.kernel:
            self.near_refused = "this decoder has no fused kernel"
        elif not chunks:
            self.near_refused = "the prefix has no full chunk"
        elif not kernels_match(self.client.topology, chunks, near.kernel):
            self.near_refused = "the shards holding it run another attention kernel"
        else:
            return near
        return None


def publish_source(
    client: StoreClient,
    tokens: Sequence[int],
    source: FullKVSource,
    layout: KVLayout,
    namespace: str = "",
) -> CachedPrefix:
    """Store a prefix whose full KV another source holds (e.g. a fresh exact prefill)."""
    kv = []
    for index in range(layout.num_layers):
        shape = (layout.num_kv_heads, source.length, layout.head_dim)
        k, v = (
            torch.empty(shape, dtype=layout.torch_dtype),
            torch.empty(shape, dtype=layout.torch_dtype),
        )
        source.read_layer(index, k, v)
        kv.append((k, v))
    return client.publish_prefix(list(tokens), kv, layout, namespace).prefix
