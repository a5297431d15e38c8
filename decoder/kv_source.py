"""Where the full prefix KV comes from, and how a verification consumes it layer by layer.

The engine never holds a request's full prefix KV. It holds a `FullKVSource`, which
delivers one layer of the prefix at a time into a buffer the caller owns: host memory in
this module (`LocalKVSource`), the remote prefix store in `prefix_store`'s client. An
exact-mode pass (suffix prefill or verification) sees the prefix through a `StagedCache`:
at each layer the prefix layer is read into a reusable staging buffer, the request's own
tail (the exact KV of its tokens after the prefix) is placed after it, the pass attends,
and the new tokens' KV moves to the tail. At most one layer of full KV is staged at once.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from decoder.config import ModelConfig, ceil_to
from decoder.kv_cache import KVCache, LayerKV


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


def assemble_layer(
    source: FullKVSource, tail: KVCache, index: int, tail_length: int, out: LayerKV
) -> float:
    """Write layer `index` of prefix + tail (its first `tail_length` tokens) into `out` as a
    dense layer from position 0; returns the seconds spent reading the source."""
    p, t = source.length, tail_length
    t0 = time.perf_counter()
    source.read_layer(index, out.k[:, :p], out.v[:, :p])
    fetch_s = time.perf_counter() - t0
    layer = tail.layers[index]
    out.k[:, p : p + t] = layer.k[:, :t]
    out.v[:, p : p + t] = layer.v[:, :t]
    out.positions[: p + t] = torch.arange(p + t)
    out.length, out.dense = p + t, True
    return fetch_s


class StagingArea:
    """One reusable buffer holding a single layer of full KV during exact passes.

    Its size is the largest staged layer so far; `peak_bytes` reports it. Slots past the
    live ones keep finite (stale) values, which exact attention masks.
    """

    def __init__(self, config: ModelConfig, granule: int) -> None:
        self._config = config
        self._granule = granule
        self._buffer: LayerKV | None = None
        self.fetch_s = 0.0
        """Seconds spent reading prefix layers from sources."""

    @property
    def peak_bytes(self) -> int:
        buf = self._buffer
        return 0 if buf is None else 2 * buf.k.numel() * buf.k.element_size()

    def acquire(self, capacity: int) -> LayerKV:
        """An empty dense layer buffer with room for `capacity` tokens."""
        buf = self._buffer
        if buf is None or buf.capacity < capacity:
            c = self._config
            buf = LayerKV(
                c.num_kv_heads, c.head_dim, self._granule, ceil_to(capacity, self._granule)
            )
            self._buffer = buf
        buf.length, buf.dense = 0, True
        return buf


class StagedCache:
    """A request's full KV for one exact pass: a streamed prefix plus its resident tail.

    `tail` holds the exact KV of positions prefix.length onward. During the pass, every
    layer's new tokens are appended to the tail; the caller truncates the tail afterwards
    to keep only what was accepted.
    """

    def __init__(
        self, source: FullKVSource, tail: KVCache, staging: StagingArea, extra: int
    ) -> None:
        """extra: how many new tokens the pass appends (sizes the staging buffer)."""
        self.source = source
        self.tail = tail
        self._staging = staging
        self._extra = extra
        self._tail_length = len(tail)  # fixed for the pass: release() grows the tail
        self._staged: LayerKV | None = None
        self._start = 0

    @property
    def next_position(self) -> int:
        return self.source.length + self._tail_length

    @property
    def dense(self) -> bool:
        return True

    def layer(self, index: int) -> LayerKV:
        p, t = self.source.length, self._tail_length
        buf = self._staging.acquire(p + t + self._extra)
        self._staging.fetch_s += assemble_layer(self.source, self.tail, index, t, buf)
        self._staged, self._start = buf, p + t
        return buf

    def release(self, index: int) -> None:
        buf, start = self._staged, self._start
        assert buf is not None, "release without layer"
        self.tail.layers[index].append(
            buf.k[:, start : buf.length],
            buf.v[:, start : buf.length],
            buf.positions[start : buf.length],
        )
        self._staged = None
