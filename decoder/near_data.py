"""Near-data verification: a prefix's attention computed on the shards that hold its KV.

A verification pass needs, per layer, attention of the pass's query rows over the whole
prefix. Pulling the prefix's full KV for it moves bytes that scale with the prefix length;
here the decoder keeps only the prefix's last, partial store chunk (`head`, fetched once,
under `base` tokens of the next full chunk) and, per layer, sends the pass's query rows to
the shards holding the prefix's full chunks. Each shard returns its chunks' attention
partials, computed with the very kernel the decoder runs (`numerics.cpu.partials`; equal
kernel fingerprints are required), and the runner folds them in chunk order before its own
chunks: bitwise what attention over a pulled copy gives. Bytes on the wire per pass scale
with the rows verified (per layer: the rows' queries out, one partial per chunk and row back),
not with the prefix's bytes.

A shard that fails mid-pass is replaced by a replica inside the session (the store SDK);
when that is impossible the pass raises `PrefixUnavailable` and the engine undoes it and
retries with the prefix pulled (or recomputed): a token never leaves a partial pass.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from dataclasses import dataclass, replace

import torch

from decoder.staging import PrefixUnavailable
from numerics.cpu.partials import Partials, kernel_fingerprint
from prefix_store.client import CachedPrefix, StoreClient
from prefix_store.errors import StoreError
from prefix_store.protocol.attend import FLOAT32, MAX_ROWS

RESPONSE_BYTES = 16 << 20
"""Partials one query may ask of a shard (shards refuse answers over their message limit,
64 MiB by default): longer passes are split into several queries per layer."""
FIELDS = ("m", "l", "acc")
RECENT = 8
"""Near-data passes whose transfer waits are remembered (`NearData.transfer_s`)."""
PROBE_BYTES = 4 << 20
"""What measuring the link's rate may read, once per decoder (`NearData.measure_link`): a
third of a second at 100 Mbit/s, enough to be bandwidth-bound at 1 GB/s."""

log = logging.getLogger(__name__)


@dataclass
class NearStats:
    """What near-data passes of one prefix cost (summed over its passes)."""

    passes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wire_s: float = 0.0
    """Seconds the decoder waited for partials (round trips and the shards' compute)."""
    shard_s: float = 0.0
    """Of which the shards computed (per query, the slowest shard's compute)."""

    @property
    def bytes(self) -> int:
        return self.bytes_sent + self.bytes_received

    def add(self, other: NearStats) -> None:
        self.passes += other.passes
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.wire_s += other.wire_s
        self.shard_s += other.shard_s


class NearData:
    """One cached prefix's near-data attention: the chunks below `base` stay on the shards."""

    def __init__(self, client: StoreClient, prefix: CachedPrefix, source, heads: int) -> None:
        size = prefix.layout.chunk_tokens
        full = [c for c in prefix.chunks if c.tokens == size]
        self.client = client
        self.prefix = prefix
        self.source = source
        """The prefix's `FullKVSource` (what a failure names, so the engine can recover)."""
        self.heads = heads
        self.kernel = kernel_fingerprint()
        self.base = len(full) * size
        self.length = prefix.tokens
        self.stats = NearStats()
        self.skip = False
        """The last near-data try was refused as busy: the next pass pulls."""
        self.pulled_passes = 0
        """Passes pulled since near-data was last tried (`auto` placement)."""
        self.recent: collections.deque[float] = collections.deque(maxlen=RECENT)
        self.recent_waits: collections.deque[float] = collections.deque(maxlen=RECENT)
        """Whole waits for partials of the same passes, shards' compute included."""
        """Transfer waits of the latest near-data passes (their wait for partials less the
        shards' compute)."""
        layout = prefix.layout
        per_row = len(full) * heads * (layout.head_dim + 2) * FLOAT32
        self.rows_per_query = max(1, min(MAX_ROWS, RESPONSE_BYTES // max(1, per_row)))
        """Rows sent in one query: the shards' row bound, and answers within RESPONSE_BYTES
        even when one shard holds every chunk."""
        self.head_bandwidth = 0.0
        """Bytes per second the head's fetch achieved (0: not measured). A few tokens' fetch
        is mostly one round trip: a floor of the link's rate (`pull_bandwidth`)."""
        self._head: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def transfer_s(self) -> float:
        """What a near-data verification pass costs in transfer: the least of the recent
        passes' waits (a suffix prefill's many rows make its pass no typical one); what
        `auto` placement and resident copies weigh against pulling."""
        return min(self.recent, default=0.0)

    @property
    def wait_s(self) -> float:
        """What a near-data pass keeps the decoder waiting, the shards' compute included: the
        least of the recent passes' waits. A resident copy saves all of it (local attention
        over a few rows is a small part of it, and on a machine shared with the shards their
        compute takes the decoder's own cores)."""
        return min(self.recent_waits, default=0.0)

    @property
    def head_tokens(self) -> int:
        """Tokens of the prefix kept here: its last chunk when that one is partial."""
        return self.length - self.base

    @property
    def head_bytes(self) -> int:
        layout = self.prefix.layout
        return layout.chunk_bytes(self.head_tokens) if self.head_tokens else 0

    def load_head(self) -> None:
        """Fetch the prefix's partial last chunk (every layer) once; raises StoreError.
        First, where this decoder has not measured its link yet, `measure_link`."""
        self.measure_link()
        if self._head is not None or not self.head_tokens:
            return
        layout = self.prefix.layout
        last = self.prefix.chunks[-1]
        alone = CachedPrefix(
            self.prefix.namespace, layout, last.tokens, (replace(last, index=0, start=0),)
        )
        shape = (layout.num_layers, layout.num_kv_heads, last.tokens, layout.head_dim)
        k, v = torch.empty(shape), torch.empty(shape)
        started = time.perf_counter()
        nbytes = self.client.fetch_layers(alone, k, v, 0, layout.num_layers)
        self.head_bandwidth = nbytes / max(1e-6, time.perf_counter() - started)
        self._head = (k, v)

    def measure_link(self) -> None:
        """Measure the link's rate where the client's `LinkMeter` has no bulk read yet: read
        the first layers of the prefix's full chunks, about `PROBE_BYTES`, and drop them.
        Without it, the pull a resident copy or `auto` placement weighs is priced at the
        head's latency-bound rate, or, with no partial chunk, not at all (then the copy was
        always made, even where its read takes seconds). A failed probe leaves that."""
        if self.client.link.bandwidth:
            return
        layout = self.prefix.layout
        full = CachedPrefix(
            self.prefix.namespace,
            layout,
            self.base,
            self.prefix.chunks[: self.base // layout.chunk_tokens],
        )
        layers = max(1, min(layout.num_layers, PROBE_BYTES // layout.segment_bytes(self.base)))
        shape = (layers, layout.num_kv_heads, self.base, layout.head_dim)
        try:
            self.client.fetch_layers(full, torch.empty(shape), torch.empty(shape), 0, layers)
        except StoreError as error:
            log.info("the link's rate is unmeasured: the probe failed (%r)", error)

    @property
    def pull_bandwidth(self) -> float:
        """Bytes per second a pull of the prefix gets from here: the client's bulk reads
        (`LinkMeter`), else the head's fetch (0.0: neither measured)."""
        return self.client.link.bandwidth or self.head_bandwidth

    def head_layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index` of the prefix's positions [base, length): [KVH, head_tokens, D]."""
        if self._head is None:
            raise RuntimeError("load_head() first")
        return self._head[0][index], self._head[1][index]

    def begin_pass(self) -> RemotePass:
        """A pass's remote attention (opened lazily at the first layer's rows)."""
        return RemotePass(self)


class RemotePass:
    """The near-data attention of one exact pass: one store session, a query per layer."""

    def __init__(self, near: NearData) -> None:
        self.near = near
        self.base = near.base
        self.stats = NearStats(passes=1)
        """What this pass cost (added to the prefix's `near.stats` on close)."""
        self._session = None
        self._started: int | None = None  # the layer whose query is in flight

    def start(self, layer: int, q: torch.Tensor) -> None:
        """Send layer `layer`'s rows now and collect the partials in `partials`: the runner
        starts every prefix's query of a layer before it waits for any, so passes over
        several prefixes wait for the slowest round trip, not for their sum. (A pass too
        long for one query sends its queries in `partials`, one after another.)"""
        if q.shape[0] > self.near.rows_per_query:
            return
        with self._failures():
            self._open().submit(layer, q)
            self._started = layer

    def partials(self, layer: int, q: torch.Tensor) -> Partials:
        """The partials of the prefix's chunks below `base` for rows q [T, H, D] (scaled),
        chunks in position order; raises PrefixUnavailable when they cannot be had."""
        with self._failures():
            if self._started == layer:
                self._started = None
                return self._open().collect()
            step = self.near.rows_per_query
            if q.shape[0] <= step:
                return self._open().query(layer, q)
            parts = [
                self._open().query(layer, q[i : i + step].contiguous())
                for i in range(0, q.shape[0], step)
            ]
            return Partials(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in FIELDS))

    def _open(self):
        if self._session is None:
            near = self.near
            self._session = near.client.open_attention(near.prefix, near.heads, near.kernel)
        return self._session

    @contextlib.contextmanager
    def _failures(self):
        """Any failure undoes the pass (PrefixUnavailable), never a token; times the wait."""
        started = time.perf_counter()
        try:
            yield
        except Exception as error:  # noqa: BLE001 - whatever failed, the pass is redone
            self._started = None
            raise PrefixUnavailable(self.near.source, error) from error
        finally:
            self.stats.wire_s += time.perf_counter() - started

    def close(self) -> NearStats:
        """Close the session; returns what this pass cost (bytes, waits)."""
        session, self._session = self._session, None
        if session is not None:
            self.stats.bytes_sent = session.bytes_sent
            self.stats.bytes_received = session.bytes_received
            self.stats.shard_s = session.shard_s
            session.close()
        near = self.near
        near.recent.append(max(0.0, self.stats.wire_s - self.stats.shard_s))
        near.recent_waits.append(self.stats.wire_s)
        near.stats.add(self.stats)
        return self.stats
