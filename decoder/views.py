"""A request's KV seen through a buffer it shares with the other requests of its prefix.

Requests over one prefix share one copy of the prefix's KV per layer (a staged layer during
an exact pass, a resident layer in the full-KV baseline, the compressed prefix when
drafting). The runner processes sequences one after another within a layer, so a request
borrows the shared layer buffer for its turn: its own tail (the KV of its tokens after the
prefix) is written right after the prefix, it attends, and the new tokens' KV moves to its
tail on `release`. Slots after a request's live ones hold finite values of other requests,
which attention masks (exact mode) or never sees (the layer's `length` stops before them).

Cost per request and layer: copying its tail (a few hundred tokens at most), instead of a
private copy of the whole prefix.

With near-data attention the buffer holds only the prefix's positions from `base` on (its
last, partial store chunk) and the tail: slot j holds position base + j, and the runner
gets the partials of positions [0, base) from `remote` (`decoder.near_data`).
"""

from __future__ import annotations

from collections.abc import Callable

from decoder.kv_cache import KVCache, LayerKV


class SharedPrefixView:
    """A dense `SeqCache` over a shared prefix layer provider plus the request's own tail.

    `layers(i)` returns a buffer whose slots [0, prefix_length - base) hold layer i of the
    prefix from position `base` on, with capacity for the rest of the prefix + tail + the
    tokens this pass appends; slot j holds position base + j.
    """

    def __init__(
        self,
        layers: Callable[[int], LayerKV],
        prefix_length: int,
        tail: KVCache,
        prefix_id: object | None = None,
        base: int = 0,
        remote: object | None = None,
    ) -> None:
        self._layers = layers
        self.prefix_length = prefix_length
        self.base = base
        self.remote = remote
        """Near-data attention of positions [0, base) (`decoder.near_data.RemotePass`), or
        None when the buffer holds the whole prefix (base 0)."""
        self.prefix_id = prefix_id
        """Equal (and not None) for the views of one pass whose `layers(i)` return the same
        buffer for every i: their slots [0, prefix_length) hold the same prefix KV, which the
        runner may then attend to once for all of their rows."""
        self.tail = tail
        self._tail_length = len(tail)  # fixed for the pass: release() grows the tail
        self._borrowed: LayerKV | None = None

    @property
    def next_position(self) -> int:
        return self.prefix_length + self._tail_length

    @property
    def dense(self) -> bool:
        return True

    def layer(self, index: int) -> LayerKV:
        buf = self._layers(index)
        p, t = self.prefix_length - self.base, self._tail_length
        own = self.tail.layers[index]
        buf.k[:, p : p + t] = own.k[:, :t]
        buf.v[:, p : p + t] = own.v[:, :t]
        buf.length, buf.dense = p + t, True
        self._borrowed = buf
        return buf

    def release(self, index: int) -> None:
        buf = self._borrowed
        assert buf is not None, "release without layer"
        start = self.next_position - self.base
        self.tail.layers[index].append(
            buf.k[:, start : buf.length],
            buf.v[:, start : buf.length],
            buf.positions[start : buf.length],
        )
        self._borrowed = None
