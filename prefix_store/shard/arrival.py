"""What a put computes over a chunk's bytes as they arrive: each layer's CRC-32C and the
chunk's content digest, in one pass while the bytes are still in cache (`ArrivalCheck`).

A chunk is stored layer-major: its layers back to back, each layer its K heads then its V
heads. A layer's bytes arrive in that stored order, in pieces (the data plane: one piece a
head, K then V; a gRPC put: the whole layer at once). Layers may arrive in any order over
gRPC (the data plane sends them in order): the digest, which must see the layers in order,
takes a layer that came early once every layer before it is in."""

from __future__ import annotations

from prefix_store.blob import crc32c, crc32c_combine
from prefix_store.provenance import content_hasher


class ArrivalCheck:
    """One chunk of a put. `arrived` each piece once its bytes are in their final buffer;
    `digest` and `crc` once every layer is complete. Not thread-safe (one put's receiver)."""

    def __init__(self, layers: int, segment_bytes: int) -> None:
        self.segment_bytes = segment_bytes
        self.crcs = [0] * layers
        """Each layer's CRC-32C so far (complete once its bytes are all in)."""
        self._filled = [0] * layers
        self._hasher = content_hasher()
        self._hashed = 0
        """Layers folded into the digest, in order; the next one's first `_partial` bytes too."""
        self._partial = 0
        self._early: dict[int, memoryview] = {}
        """Complete layers past `_hashed`, waiting for the ones before them."""

    def arrived(self, layer: int, piece: memoryview, segment: memoryview) -> None:
        """The next bytes of `layer` (`piece`, within `segment`, the layer's final buffer)."""
        self.crcs[layer] = crc32c(piece, self.crcs[layer])
        if layer == self._hashed and self._filled[layer] == self._partial:
            self._hasher.update(piece)
            self._partial += len(piece)
        self._filled[layer] += len(piece)
        if self._filled[layer] == self.segment_bytes:
            self._complete(layer, segment)

    def _complete(self, layer: int, segment: memoryview) -> None:
        if layer != self._hashed:
            self._early[layer] = segment
            return
        self._hasher.update(segment[self._partial :])
        self._hashed, self._partial = layer + 1, 0
        while self._hashed in self._early:
            self._hasher.update(self._early.pop(self._hashed))
            self._hashed += 1

    @property
    def complete(self) -> bool:
        return self._hashed == len(self.crcs)

    def digest(self) -> bytes:
        """The content digest of the chunk's layer-major bytes (every layer complete)."""
        assert self.complete, "the digest of an incomplete chunk"
        return self._hasher.digest()

    def crc(self) -> int:
        """The CRC-32C of the chunk's layer-major bytes, from its layers' CRCs."""
        crc = 0
        for layer_crc in self.crcs:
            crc = crc32c_combine(crc, layer_crc, self.segment_bytes)
        return crc
