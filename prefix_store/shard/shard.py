"""A shard: the chunks and artifacts placed on it, in a memory tier spilling to disk.

The facade over its nouns: what it holds (`holdings`: the tiers with their placement,
leases, claims, usage), the puts it is receiving (`receiving`), its reads (`reads`: fetches
and scrubbing) and its artifacts (`artifacts`). `reserve`, `open_fetch`, `fetch`,
`put_artifact` and `fetch_artifact` are those parts' own methods, bound on the shard.

Thread-safe: index changes happen under one lock; bytes are copied out of leased blobs
without it, and disk writes and removals happen after the change that staged them, also
without it. Every read checks the blob's CRC-32C; a blob that fails is dropped and the read
fails with `DataLoss` (a later lookup reports a miss). Nothing here knows about tenants'
tokens or gRPC: callers pass resolved namespaces and owners.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from prefix_store.blob import Blob, BlobId
from prefix_store.config import ShardConfig
from prefix_store.layout import KVLayout
from prefix_store.namespace import Namespace
from prefix_store.protocol.tokens import validate_tokens
from prefix_store.provenance import Verifier
from prefix_store.shard import deletes, lookup, puts, reads
from prefix_store.shard.artifacts import Artifacts
from prefix_store.shard.deletes import ANYONE, Deletable
from prefix_store.shard.holdings import Holdings
from prefix_store.shard.lookup import LookupResult
from prefix_store.shard.puts import Committed, PutSession
from prefix_store.shard.reads import Reader
from prefix_store.shard.receiving import Receiving
from prefix_store.shard.usage import QuotaCheck


class Shard:
    def __init__(
        self, config: ShardConfig, weight: Callable[[str], float] = lambda tenant: 1.0
    ) -> None:
        """`weight(tenant)`: the tenant's weight in the shares of the receive budget."""
        self.config = config
        self.verifier = Verifier(config.provenance_key) if config.provenance_key else None
        self.holdings = Holdings(config)
        self.memory, self.disk = self.holdings.placement.memory, self.holdings.placement.disk
        self.stats = self.holdings.stats
        self.receiving = Receiving(config, self.holdings, weight)
        self.reads = Reader(self.holdings)
        self.artifacts = Artifacts(self.holdings, self.reads, self.verifier)
        # Operations its parts declare, bound under the names callers use (one copy of
        # each signature and contract: see the part's method).
        self.reserve = self.receiving.reserve
        self.open_fetch = self.reads.open_fetch
        self.fetch = functools.partial(reads.fetch, self.reads)
        self.put_artifact = self.artifacts.put
        self.fetch_artifact = self.artifacts.fetch
        self.open_artifact_read = self.artifacts.open_read

    def lookup(
        self,
        namespace: Namespace,
        layout: KVLayout,
        token_ids: Sequence[int],
        indices: Sequence[int] = (),
    ) -> LookupResult:
        """Which of the requested chunks of `token_ids` are held here; for the first one
        that is not, the longest stored partial chunk that starts it."""
        return lookup.lookup(self.config, self.holdings, namespace, layout, token_ids, indices)

    # ---- put ---------------------------------------------------------------------------

    def begin_put(
        self,
        namespace: Namespace,
        layout: KVLayout,
        token_ids: Sequence[int],
        indices: Sequence[int],
        owner: str,
        quota: QuotaCheck,
        signatures: Sequence[bytes] = (),
        weight: float | None = None,
    ) -> PutSession:
        """A put of chunks `indices` of `token_ids`, checked and admitted (`reserve`;
        `weight`: the owner's in the shares of the receive budget)."""
        self.config.layouts.check(layout, "header.layout")
        ids = validate_tokens(token_ids, "header.token_ids", self.config.max_tokens)
        return PutSession(self, namespace, layout, ids, indices, owner, quota, signatures, weight)

    def check_signature(self, statement: bytes, signature: bytes, what: str) -> bool:
        """Whether a put's signature was checked (True) or there was none / no key to
        check it with (False); a signature that fails the check refuses the put."""
        return puts.check_signature(self.verifier, statement, signature, what)

    def commit(self, blobs: list[Blob], owner: str, quota: QuotaCheck) -> Committed:
        """Make complete, checked blobs visible, all or none. A signed blob replaces an
        unsigned one of the same key (an unreferenced one: a leased one is UNAVAILABLE)."""
        return puts.commit(self.holdings, blobs, owner, quota)

    def new_bytes(self, namespace: Namespace, keys: Sequence[int], sizes: Sequence[int]) -> int:
        """Bytes a put of these chunks would add (chunks already stored cost nothing)."""
        return puts.new_bytes(self.holdings, namespace, keys, sizes)

    def received(self, owner: str | None = None) -> int:
        """Bytes of puts arriving that are buffered now (`owner`'s, or everyone's)."""
        return self.receiving.held(owner)

    # ---- delete ------------------------------------------------------------------------

    def delete(
        self,
        namespace: Namespace,
        layout: KVLayout,
        token_ids: Sequence[int],
        may: Deletable = ANYONE,
    ) -> tuple[int, int, int]:
        """Drop every chunk of `token_ids` held here and the artifacts of those prefixes,
        those that `may` allows. Returns (chunks, artifacts, bytes)."""
        return deletes.delete(self.config, self.holdings, namespace, layout, token_ids, may)

    def delete_keys(
        self, namespace: Namespace, keys: Sequence[int], may: Deletable = ANYONE
    ) -> tuple[int, int, int]:
        """Undo the caller's put of these chunks: each loses one claim of the caller's own
        (`may.caller`; another tenant's claims are never touched) and is dropped only when
        no put claims it any more (a concurrent publish that found it present keeps it),
        and when `may` allows. Keys of absent chunks change nothing (no state is kept for
        them). Returns (chunks dropped, 0, bytes)."""
        return deletes.delete_keys(self.holdings, namespace, keys, may)

    # ---- usage, scrubbing, shutdown ----------------------------------------------------

    def usage(self) -> dict[str, int]:
        """Bytes each owner's blobs hold here."""
        with self.holdings.lock:
            return dict(self.stats.usage)

    def accounting(self) -> tuple[int, int]:
        """(bytes of the distinct blobs held, bytes charged to their owners): equal unless
        the accounting is wrong (checked after faults by `make chaos`, on a quiet shard).
        Summed in slices of `holdings.ACCOUNTING_SLICE` blobs, the lock taken per slice, no
        blob's recency changed (eviction stays least recently used): a change made
        meanwhile may show as a passing difference."""
        return self.holdings.accounting()

    def counts(self, owner: str | None = None) -> dict[str, int]:
        """Chunks and artifacts held (only `owner`'s when given) and leased blobs."""
        return self.holdings.counts(owner)

    def scrub_ids(self) -> list[BlobId]:
        """Every blob held now, for a scrub pass (`prefix_store.scrub`)."""
        return self.holdings.ids()

    def scrub(self, blob_id: BlobId) -> int:
        """Re-check a blob at rest: every segment against its stored CRC-32C, from the tier
        that holds it, without a lease (readers, puts and eviction never wait for it) and
        its recency unchanged. A blob that fails and is still the one read (not replaced
        or removed meanwhile) is dropped as a corrupt read drops it (counted in
        `stats.corrupt` and `stats.scrub_corrupt`), never served again. Returns the bytes
        checked (0: the blob is gone)."""
        return self.reads.scrub(blob_id)

    def flush(self) -> int:
        """Write memory-only blobs to the disk tier (graceful shutdown). Returns how many."""
        return self.holdings.flush()
