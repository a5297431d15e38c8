"""The drafter's view of a request: a compressed prefix (shared) plus the request's own tail.

The compressed prefix of one spec is held once per prefix (`DraftPrefix`) and shared by all
the requests drafting over it; each request owns only its tail (`DraftCache`): the mirror of
its exact tail (verified KV) and, during a draft round, the drafted tokens' own KV. After
verification the drafted rows are rolled back and the accepted tokens' verified KV is
copied in (DESIGN.md section 4).

A draft step borrows the prefix's layer buffer (see `decoder.views` for the pattern): the
request's tail is written after the compressed prefix, the step attends over views, and the
new token's KV lands in the request's own tail. An unquantized compressed prefix is copied
once into its buffer. A quantized one stays packed and is decoded into a scratch buffer
shared by every prefix, once per layer and draft step whatever the number of requests over
it: its memory saving is real, and so is the decoding cost.
"""

from __future__ import annotations

import itertools

import torch

from decoder.compressors import CompressedKV, CompressedLayer
from decoder.kv_cache import KVCache


class _Buffer:
    """[KVH, cap, D] keys and values with per-head positions."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int) -> None:
        self.k = torch.zeros(kv_heads, capacity, head_dim)
        self.v = torch.zeros(kv_heads, capacity, head_dim)
        self.positions = torch.zeros(kv_heads, capacity, dtype=torch.long)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.positions))

    def fill(self, layer: CompressedLayer) -> None:
        k, v = layer.materialize()
        n = layer.kept
        self.k[:, :n], self.v[:, :n] = k, v
        self.positions[:, :n] = layer.positions


_uids = itertools.count(1)


class DraftScratch:
    """One layer buffer into which quantized prefixes are decoded for a draft step."""

    def __init__(self, kv_heads: int, head_dim: int) -> None:
        self._shape = (kv_heads, head_dim)
        self._buffer: _Buffer | None = None
        self._holds: tuple[int, int] | None = None  # (prefix uid, layer) decoded in it

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.nbytes

    def drop(self) -> None:
        self._buffer, self._holds = None, None

    def decoded(self, owner: DraftPrefix, index: int, capacity: int) -> _Buffer:
        buf = self._buffer
        if buf is None or buf.capacity < capacity:
            buf = self._buffer = _Buffer(*self._shape, capacity)
            self._holds = None
        tag = (owner.uid, index)
        if self._holds != tag:
            self._holds = None  # until filled: a fill that raises leaves nothing claimed
            buf.fill(owner.compressed.layers[index])
            self._holds = tag
        return buf


class DraftPrefix:
    """A prefix's compressed KV, shared by every request drafting over it."""

    def __init__(
        self, compressed: CompressedKV, kv_heads: int, head_dim: int, scratch: DraftScratch
    ) -> None:
        self.compressed = compressed
        self.uid = next(_uids)
        self.prefix_length = compressed.prefix_length
        self.shape = (kv_heads, head_dim)
        self._scratch = scratch
        self.room = 0
        self._resident: list[_Buffer | None] = [None] * len(compressed.layers)
        self.ensure_room(1)

    def ensure_room(self, tail_capacity: int) -> None:
        """Make every layer buffer hold the prefix plus `tail_capacity` tail tokens."""
        if tail_capacity <= self.room:
            return
        for index, layer in enumerate(self.compressed.layers):
            if not layer.quantized:
                buf = _Buffer(*self.shape, layer.kept + tail_capacity)
                buf.fill(layer)
                self._resident[index] = buf
        self.room = tail_capacity  # (only once every layer has it)

    @property
    def nbytes(self) -> int:
        """Resident bytes: unquantized buffers (prefix + tail room) and packed layers."""
        return sum(
            buf.nbytes if buf is not None else layer.nbytes
            for buf, layer in zip(self._resident, self.compressed.layers, strict=True)
        )

    def layer(self, index: int) -> tuple[_Buffer, int]:
        """The layer's buffer with the compressed prefix in slots [0, base), and base."""
        layer = self.compressed.layers[index]
        buf = self._resident[index]
        if buf is None:
            buf = self._scratch.decoded(self, index, layer.kept + self.room)
        return buf, layer.kept


class _Turn:
    """A request's turn on a shared draft layer: what the runner appends to and reads."""

    __slots__ = ("_buf", "_base", "_own", "_cache")

    def __init__(self, buf: _Buffer, base: int, own: _Buffer, cache: DraftCache) -> None:
        self._buf, self._base, self._own, self._cache = buf, base, own, cache

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: [KVH, t, D]; positions: [t] (the same for every head)."""
        t0 = self._cache.tail_length
        t1 = t0 + positions.shape[0]
        if t1 > self._own.capacity:
            raise RuntimeError(f"draft tail overflow: {t1} > {self._own.capacity} tokens")
        for buf, start in ((self._own, t0), (self._buf, self._base + t0)):
            end = start + (t1 - t0)
            buf.k[:, start:end], buf.v[:, start:end] = k, v
            buf.positions[:, start:end] = positions
        self._cache.appended = t1

    def live(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        end = self._base + self._cache.appended
        return self._buf.k[:, :end], self._buf.v[:, :end], self._buf.positions[:, :end]


class DraftCache:
    """A request's draft KV (a `SeqCache` for fast-mode forwards): a shared compressed
    prefix and its own tail of `tail_capacity` tokens."""

    def __init__(self, prefix: DraftPrefix, tail_capacity: int) -> None:
        prefix.ensure_room(tail_capacity)
        self.prefix = prefix
        self.prefix_length = prefix.prefix_length
        kv_heads, head_dim = prefix.shape
        self._own = [_Buffer(kv_heads, head_dim, tail_capacity) for _ in prefix.compressed.layers]
        self.tail_length = 0
        self.appended = 0  # tail length during a forward call (layers catch up one by one)

    @property
    def next_position(self) -> int:
        return self.prefix_length + self.tail_length

    @property
    def dense(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        """Bytes this request owns (the shared prefix is counted by `DraftPrefix`)."""
        return sum(buf.nbytes for buf in self._own)

    def layer(self, index: int) -> _Turn:
        buf, base = self.prefix.layer(index)
        own, t = self._own[index], self.tail_length
        buf.k[:, base : base + t] = own.k[:, :t]
        buf.v[:, base : base + t] = own.v[:, :t]
        buf.positions[:, base : base + t] = own.positions[:, :t]
        self.appended = t
        return _Turn(buf, base, own, self)

    def release(self, index: int) -> None:
        if index == len(self._own) - 1:
            self.tail_length = self.appended  # every layer now holds the new tokens

    def truncate(self, tail_length: int) -> None:
        """Roll back to the first `tail_length` tail tokens."""
        self.tail_length = self.appended = tail_length

    def copy_tail(self, tail: KVCache, start: int, end: int) -> None:
        """Append rows [start, end) of the exact tail (verified KV) to every layer; the
        draft tail must hold exactly `start` tokens."""
        if self.tail_length != start:
            raise RuntimeError(f"draft tail holds {self.tail_length} tokens, expected {start}")
        if end > self._own[0].capacity:
            raise RuntimeError(f"draft tail overflow: {end} > {self._own[0].capacity} tokens")
        for own, exact in zip(self._own, tail.layers, strict=True):
            own.k[:, start:end], own.v[:, start:end] = exact.k[:, start:end], exact.v[:, start:end]
            own.positions[:, start:end] = exact.positions[start:end]
        self.tail_length = self.appended = end
