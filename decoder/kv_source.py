"""Where the full prefix KV comes from, and how a verification consumes it layer by layer.

The engine never holds a request's full prefix KV (except in the full-KV baseline). It
holds a `FullKVSource`, which delivers one layer of the prefix at a time into a buffer the
caller owns: host memory in this module (`LocalKVSource`), the remote prefix store in
`decoder.store_source`. Exact passes stage the layers they need in a bounded ring
(`decoder.staging`) and see them through `decoder.views`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from decoder.kv_cache import KVCache


class FullKVSource(Protocol):
    """The full KV of a cached prefix (positions 0 .. length-1), one layer at a time."""

    @property
    def length(self) -> int:
        """Tokens in the prefix."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of the prefix's keys and values over all layers."""
        ...

    def read_layer(self, index: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Write layer `index`'s keys and values into k_out, v_out: [KVH, length, D] each.

        Raises an error (never writes partial data silently) when the layer cannot be read.
        """
        ...


class LocalKVSource:
    """A prefix's full KV resident in host memory (the paper's long-context deployment)."""

    def __init__(self, cache: KVCache, length: int | None = None) -> None:
        n = len(cache) if length is None else length
        if not cache.dense or not 0 < n <= len(cache):
            raise ValueError("a prefix source needs a dense cache holding positions 0 .. n-1")
        self._cache = cache
        self._length = n

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        layer = self._cache.layers[0]
        per_layer = 2 * layer.k.shape[0] * self._length * layer.k.shape[2] * layer.k.element_size()
        return per_layer * len(self._cache.layers)

    def read_layer(self, index: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        layer = self._cache.layers[index]
        k_out.copy_(layer.k[:, : self._length])
        v_out.copy_(layer.v[:, : self._length])
