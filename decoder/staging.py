"""Staging of full prefix KV for exact passes: a bounded ring of layer buffers, filled ahead.

An exact pass (suffix prefill or verification) consumes the full KV of its prefixes layer
by layer: for layer 0, every prefix of the pass in order, then layer 1, and so on. The
`LayerRing` holds `depth` layer buffers. A reader thread fills them in exactly that order
from the prefixes' `FullKVSource`s, so the pull of layer i+1 runs while the pass computes
on layer i, and the first `depth` layers of the next pass arrive while the engine drafts
(`begin` is called before the draft step that precedes a verification).

Each prefix layer is read once per pass, whatever the number of requests over it: the
requests of one prefix attend over the same staged buffer, each writing its own tail after
the prefix before attending (`decoder.views`). Resident bytes are bounded by
`depth` x (the largest prefix + tail room) x one layer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoder.config import ModelConfig, ceil_to
from decoder.errors import DecoderError
from decoder.kv_cache import LayerKV
from decoder.kv_source import FullKVSource


class PrefixUnavailable(DecoderError):
    """A prefix's full KV could not be read (store unreachable, chunk lost, ...)."""

    def __init__(self, source: FullKVSource, cause: BaseException) -> None:
        super().__init__(f"the prefix's full KV could not be read: {cause}")
        self.source = source
        self.cause = cause


@dataclass(frozen=True, slots=True)
class PassGroup:
    """One prefix in a pass, with the room its requests need after it."""

    source: FullKVSource
    capacity: int
    """Slots needed: prefix length + the largest tail (and new tokens) of its requests."""


@dataclass
class _Slot:
    buffer: LayerKV
    item: int = -1  # index into the pass order it holds (-1: free)
    ready: bool = False
    error: BaseException | None = None


@dataclass
class RingStats:
    layers: int = 0
    bytes: int = 0
    read_s: float = 0.0
    """Seconds the reader spent reading layers (transfer time)."""
    stall_s: float = 0.0
    """Seconds passes waited for a layer (the part of the transfer not hidden)."""

    @property
    def bandwidth(self) -> float:
        """Bytes per second the reader achieved; 0.0 before it read anything."""
        return self.bytes / self.read_s if self.read_s > 0 else 0.0


class LayerRing:
    """`depth` reusable layer buffers, filled in pass order by a background reader."""

    def __init__(self, config: ModelConfig, granule: int, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"staging depth must be >= 1, got {depth}")
        self._config = config
        self._granule = granule
        self.depth = depth
        self._slots: list[_Slot] = []
        self._cond = threading.Condition()
        self._groups: tuple[PassGroup, ...] = ()
        self._generation = 0
        self._next_read = 0  # next item the reader fills
        self._consumed = 0  # items handed out and finished by the pass
        self._current = -1  # item the pass is using
        self._reader: threading.Thread | None = None
        self.stats = RingStats()

    # -- sizing -----------------------------------------------------------------------------

    def slot_bytes(self, capacity: int) -> int:
        """Bytes of one slot for `capacity` tokens."""
        c = self._config
        return 2 * c.num_kv_heads * ceil_to(capacity, self._granule) * c.head_dim * 4

    def bytes_for(self, capacity: int) -> int:
        """Bytes the ring holds once its slots fit `capacity` tokens."""
        return self.depth * self.slot_bytes(capacity)

    @property
    def nbytes(self) -> int:
        return sum(2 * s.buffer.k.numel() * s.buffer.k.element_size() for s in self._slots)

    # -- the pass plan ----------------------------------------------------------------------

    @property
    def groups(self) -> tuple[PassGroup, ...]:
        return self._groups

    def begin(self, groups: Sequence[PassGroup]) -> None:
        """Start reading the pass over `groups` (in this order); cancels any other plan."""
        groups = tuple(groups)
        if groups == self._groups and self._current == -1 and self._consumed == 0:
            return  # already prefetching exactly this pass
        self.cancel()
        if not groups:
            return
        self._ensure_slots(max(g.capacity for g in groups))
        with self._cond:
            self._generation += 1
            self._groups = groups
            self._next_read = self._consumed = 0
            self._current = -1
            for slot in self._slots:
                slot.item, slot.ready, slot.error = -1, False, None
            generation = self._generation
        self._reader = threading.Thread(
            target=self._read_all, args=(generation,), name="kv-prefetch", daemon=True
        )
        self._reader.start()

    def take(self, group: int, layer: int) -> LayerKV:
        """The staged buffer of `layer` of `groups[group]` (prefix in slots [0, length)).

        Consecutive calls for the same (group, layer) return the same buffer; moving on frees
        the previous one. Raises PrefixUnavailable when the reader failed on this item."""
        item = layer * len(self._groups) + group
        with self._cond:
            if item != self._current:
                if item != self._consumed + (0 if self._current == -1 else 1):
                    raise RuntimeError(f"pass order broken: item {item} after {self._current}")
                self._free_current()
                self._current = item
                self._cond.notify_all()
            slot = self._slots[item % self.depth]
            if not (slot.item == item and (slot.ready or slot.error)):
                t0 = time.perf_counter()
                while not (slot.item == item and (slot.ready or slot.error)):
                    self._cond.wait()
                self.stats.stall_s += time.perf_counter() - t0
            if slot.error is not None:
                raise PrefixUnavailable(self._groups[group].source, slot.error)
            return slot.buffer

    def finish(self) -> None:
        """The pass is over: free its last buffer, forget the plan."""
        self.cancel()

    def cancel(self) -> None:
        """Stop the reader (after the layer it is reading) and forget the plan."""
        with self._cond:
            self._generation += 1
            self._groups = ()
            self._current = -1
            self._consumed = 0
            self._cond.notify_all()
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.join()

    def drop(self) -> None:
        """Cancel and free the buffers (nothing in flight needs them)."""
        self.cancel()
        self._slots = []

    # -- internals --------------------------------------------------------------------------

    def _free_current(self) -> None:
        if self._current >= 0:
            slot = self._slots[self._current % self.depth]
            slot.item, slot.ready, slot.error = -1, False, None
            self._consumed = self._current + 1

    def _ensure_slots(self, capacity: int) -> None:
        c = self._config
        cap = ceil_to(capacity, self._granule)
        if self._slots and self._slots[0].buffer.capacity >= cap:
            return
        self._slots = []  # drop old buffers before allocating bigger ones
        for _ in range(self.depth):
            buf = LayerKV(c.num_kv_heads, c.head_dim, self._granule, cap)
            buf.positions[:] = torch.arange(buf.capacity)
            self._slots.append(_Slot(buf))

    def _read_all(self, generation: int) -> None:
        groups = self._groups
        total = len(groups) * self._config.num_layers
        for item in range(total):
            with self._cond:
                slot = self._slots[item % self.depth]
                while self._generation == generation and slot.item != -1:
                    self._cond.wait()
                if self._generation != generation:
                    return
                slot.item, slot.ready, slot.error = item, False, None
            layer, group = divmod(item, len(groups))
            source = groups[group].source
            error: BaseException | None = None
            t0 = time.perf_counter()
            try:
                p = source.length
                source.read_layer(layer, slot.buffer.k[:, :p], slot.buffer.v[:, :p])
            except BaseException as exc:  # handed to the pass, which decides what to do
                error = exc
            seconds = time.perf_counter() - t0
            with self._cond:
                if self._generation != generation:
                    return
                slot.ready, slot.error = error is None, error
                if error is None:
                    self.stats.layers += 1
                    self.stats.bytes += 2 * slot.buffer.k[:, : source.length].numel() * 4
                    self.stats.read_s += seconds
                self._cond.notify_all()
            if error is not None:
                return
