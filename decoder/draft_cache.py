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

Requests of one draft forward over the same prefix attend together (`DraftStack`), as the
verifier's do over a shared full prefix: every member's query rows attend to the compressed
prefix in one call, which reads its keys and values once for all of them instead of once
per request, and each member's rows to its own tail in one batched call; the two are merged
by their log-sum-exp. A request alone over its prefix takes the borrowed-buffer path above.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from decoder.compressors import CompressedKV, CompressedLayer
from decoder.kv_cache import KVCache
from numerics.cpu.forward import fast_attention_lse, merge_attention


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

    def append_own(self, index: int, k: torch.Tensor, v: torch.Tensor, positions) -> _Buffer:
        """Append to layer `index` of the own tail only (k, v: [KVH, t, D]; a `DraftStack`
        member's turn); returns the layer's own buffer, `appended` tokens live."""
        own, t0 = self._own[index], self.tail_length
        t1 = t0 + positions.shape[0]
        if t1 > own.capacity:
            raise RuntimeError(f"draft tail overflow: {t1} > {own.capacity} tokens")
        own.k[:, t0:t1], own.v[:, t0:t1] = k, v
        own.positions[:, t0:t1] = positions
        self.appended = t1
        return own

    def tail_positions(self) -> torch.Tensor:
        """[tail_length] positions of the own tail (the same in every layer and head)."""
        return self._own[0].positions[0, : self.tail_length]

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

    def catch_up(self, tail: KVCache) -> None:
        """Mirror the rows of the exact tail verified since this draft tail last drafted
        (`rollback` leaves them out: a request on exact steps copies nothing per round). The
        draft tail must hold a leading part of the exact tail's rows."""
        if self.tail_length < len(tail):
            self.copy_tail(tail, self.tail_length, len(tail))


class DraftStack:
    """The draft forward's sequences over one shared compressed prefix (two or more), which
    attend together at each layer (see the module docstring). Built once per forward: the
    members' row layout and their tails' mask do not change from layer to layer.

    Layouts: the stacked rows are R = sum of the members' new tokens, in member order; a
    query head h reads kv head h // G (G = heads / kv heads), so queries are grouped as
    [KVH, G * rows, D] against [KVH, keys, D].
    """

    def __init__(self, prefix: DraftPrefix, members: list[int], seqs, spans, scale: float):
        self.prefix, self.scale = prefix, scale
        self.caches: list[DraftCache] = [seqs[i].cache for i in members]
        self.spans = [spans[i] for i in members]
        self.positions = [seqs[i].positions for i in members]
        self.rows = torch.cat([torch.arange(start, end) for start, end in self.spans])
        self.new = [end - start for start, end in self.spans]
        self.lengths = [c.tail_length + t for c, t in zip(self.caches, self.new, strict=True)]
        self._tails = [  # every member's tail positions after this forward's tokens
            torch.cat([c.tail_positions(), p])
            for c, p in zip(self.caches, self.positions, strict=True)
        ]
        self._mask: torch.Tensor | None = None  # built at the first layer, kept for the rest
        self._picks = self._picked()

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The members' attention output [R, H, D] at layer `index` (q: every row of the
        forward, unscaled; k, v: every row's new keys and values [rows, KVH, D]), their new
        tokens appended to their own tails."""
        owns = [
            c.append_own(index, k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), p)
            for c, (s, e), p in zip(self.caches, self.spans, self.positions, strict=True)
        ]
        kv_heads, rows, heads = owns[0].k.shape[0], self.rows.numel(), q.shape[1]
        group = heads // kv_heads
        out, lse = self._tails_attended(q, owns, kv_heads, group)  # [KVH, G, R, D], [KVH, G, R]
        buf, base = self.prefix.layer(index)
        if base:
            grouped = q[self.rows].view(rows, kv_heads, group, -1).permute(1, 2, 0, 3)
            grouped = grouped.reshape(1, kv_heads, group * rows, -1)
            keys, values = buf.k[None, :, :base], buf.v[None, :, :base]
            prefix_out, prefix_lse = fast_attention_lse(grouped, keys, values, self.scale)
            shape = (kv_heads, group, rows)
            out = merge_attention(prefix_out.view(*shape, -1), prefix_lse.view(shape), out, lse)
        for cache in self.caches:
            cache.release(index)
        return out.permute(2, 0, 1, 3).reshape(rows, heads, -1)

    def _tails_attended(self, q, owns: list[_Buffer], kv_heads: int, group: int):
        """Every member's rows over its own tail: one call over tails padded to the longest
        (and rows to the most), masked by position; the real rows picked out."""
        members, longest, most = len(owns), max(self.lengths), max(self.new)
        dim = q.shape[-1]
        queries = q.new_zeros(members, most, kv_heads * group, dim)
        keys = q.new_zeros(members, kv_heads, longest, dim)
        values = torch.zeros_like(keys)
        for b, (own, (start, end), length) in enumerate(
            zip(owns, self.spans, self.lengths, strict=True)
        ):
            queries[b, : end - start] = q[start:end]
            keys[b, :, :length], values[b, :, :length] = own.k[:, :length], own.v[:, :length]
        queries = queries.view(members, most, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
        queries = queries.reshape(members, kv_heads, group * most, dim)
        mask = self._tail_mask(group).to(queries.dtype)
        out, lse = fast_attention_lse(queries, keys, values, self.scale, mask)
        out = out.view(members, kv_heads, group, most, dim).permute(1, 2, 0, 3, 4)
        lse = lse.view(members, kv_heads, group, most).permute(1, 2, 0, 3)
        out = out.reshape(kv_heads, group, members * most, dim).index_select(2, self._picks)
        return out, lse.reshape(kv_heads, group, members * most).index_select(2, self._picks)

    def _tail_mask(self, group: int) -> torch.Tensor:
        """Additive [members, 1, G * most, longest]: a row sees its own member's tail keys
        at positions up to its own; padding rows and keys see nothing."""
        if self._mask is None:
            members, longest, most = len(self.caches), max(self.lengths), max(self.new)
            seen = torch.zeros(members, most, longest, dtype=torch.bool)
            for b, (tail, positions) in enumerate(zip(self._tails, self.positions, strict=True)):
                seen[b, : positions.numel(), : tail.numel()] = tail[None, :] <= positions[:, None]
            mask = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
            self._mask = mask.repeat(1, group, 1).unsqueeze(1)
        return self._mask

    def _picked(self) -> torch.Tensor:
        """Each real row's index among the padded rows (member b's row i: b * most + i)."""
        most = max(self.new)
        return torch.cat([torch.arange(t) + b * most for b, t in enumerate(self.new)])


def draft_stacks(seqs: Sequence, spans, scale: float) -> dict[int, DraftStack]:
    """The stack of each sequence of a draft forward that shares its compressed prefix with
    another one in it, by sequence index."""
    groups: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        if isinstance(seq.cache, DraftCache):
            groups.setdefault(id(seq.cache.prefix), []).append(i)
    stacks: dict[int, DraftStack] = {}
    for members in groups.values():
        if len(members) > 1:
            stack = DraftStack(seqs[members[0]].cache.prefix, members, seqs, spans, scale)
            stacks.update(dict.fromkeys(members, stack))
    return stacks
