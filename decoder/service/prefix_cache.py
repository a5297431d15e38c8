"""The prefixes a decoder worker knows, shared by every request over them, and their
compressed artifacts (DESIGN.md sections 4 and 8).

A request's prefix is the leading chunks of the longest cached prefix that this deployment's
decoders signed; a prompt with no cached prefix is prefilled here (its KV held locally,
under the budget, and handed to the request's admission). A prefix's compressed artifact for
a spec is fetched once (signed ones only), or built here once from the full KV and stored for
every later request and worker, when a request's engine first drafts over it (`artifacts`).

Memory: entries are charged for their compressed artifacts; idle ones are dropped least
recently used first beyond `capacity`, or whenever a budget reservation needs their bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from decoder.budget import KVBudget
from decoder.compressors import CompressedKV, CompressorPipeline, parse_compressor
from decoder.compressors.artifact import ArtifactFormatError, from_bytes, to_bytes, validate
from decoder.engine import Prefix
from decoder.engine.prefix_work import compress_observing, prefill_bytes, prefill_prefix
from decoder.errors import Cancelled, OverBudget
from decoder.runner import ModelRunner
from decoder.service.model_thread import ModelThread
from decoder.store_source import StoreKVSource
from prefix_store.client import CachedPrefix, StoreClient
from prefix_store.errors import StoreError
from prefix_store.layout import KVLayout
from prefix_store.provenance import Signer, trusted_prefix

log = logging.getLogger(__name__)

LOCAL_PREFILL_POLL_S = 0.05
"""How often a prompt to prefill here looks again for room in the budget."""


@dataclass(eq=False)
class CacheEntry:
    """A prefix this worker knows, shared by every request over it."""

    prefix: Prefix
    cached: CachedPrefix | None  # None: prefilled here (not in the store)
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    unsigned: bool = False
    """Over KV no decoder signed (the caller opted in): what is built from it is not signed."""
    charged: int = 0
    """Budget bytes the entry holds itself: its compressed artifacts."""
    prepaid: int = 0
    """A local prefill's reserved KV bytes, until its request takes them over."""


@dataclass(frozen=True)
class EntryArtifacts:
    """A request's `ArtifactSource` (decoder.engine): its entry's artifacts, as its caller."""

    cache: PrefixCache
    entry: CacheEntry
    client: StoreClient

    def load(self, spec: str) -> CompressedKV:
        return self.cache.load_artifact(self.entry, spec, self.client)

    def keep(self, spec: str, kv: CompressedKV) -> None:
        self.cache.keep_artifact(self.entry, spec, kv)


@dataclass(frozen=True)
class CacheFigures:
    """What the cache holds (Info)."""

    idle_bytes: int
    """Budget bytes of idle entries' compressed artifacts."""
    prefixes: int


class PrefixCache:
    """Entries by (owner, namespace, key, tokens, unsigned), least recently used first.
    Thread-safe; model work runs on the `ModelThread`."""

    def __init__(
        self,
        runner: ModelRunner,
        layout: KVLayout,
        budget: KVBudget,
        model: ModelThread,
        signer: Signer,
        capacity: int,
        worker_id: str,
    ) -> None:
        """capacity: idle entries kept (`DecoderConfig.prefix_cache`)."""
        self.runner = runner
        self.layout = layout
        self.budget = budget
        self.model = model
        self.signer = signer
        self.capacity = capacity
        self.worker_id = worker_id
        self._entries: OrderedDict[tuple, CacheEntry] = OrderedDict()
        self._lock = threading.Lock()
        budget.add_reclaimer(self._reclaim_idle)

    # -- entries ------------------------------------------------------------------------------

    @contextmanager
    def held(
        self,
        client: StoreClient,
        tokens: list[int],
        namespace: str,
        unsigned: bool = False,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[CacheEntry]:
        """The entry a request decodes over (`_acquire`), held while the block runs."""
        entry = self._acquire(client, tokens, namespace, unsigned, cancelled)
        try:
            yield entry
        finally:
            self._release(entry)

    def _acquire(
        self,
        client: StoreClient,
        tokens: list[int],
        namespace: str,
        unsigned: bool,
        cancelled: Callable[[], bool],
    ) -> CacheEntry:
        """The prefix a request decodes over: the leading chunks of the longest cached prefix
        that this deployment's decoders signed (docs/DESIGN.md section 8); anything else
        stored for these tokens is never a verifier input, and is recomputed here. With
        `unsigned` (the caller's private namespace, its explicit choice) the whole cached
        prefix, kept apart from the signed one."""
        found = client.lookup(tokens, self.layout, namespace)
        cached = trusted_prefix(found, tokens, self.signer.verifier)
        unsigned = unsigned and cached.tokens < found.tokens
        if unsigned:
            cached = found
        elif cached.tokens < found.tokens:
            log.warning(
                "decoder %s: %d of %d cached tokens carry no valid signature; recomputing them",
                self.worker_id,
                found.tokens - cached.tokens,
                found.tokens,
            )
        if cached.tokens == 0:
            return self._local(tokens, cancelled)
        owner = client.topology.tenant if not namespace else ""  # private: the caller's own
        key = (owner, cached.namespace, cached.key, cached.tokens, unsigned)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                source = StoreKVSource(client, cached)
                prefix = Prefix(tokens[: cached.tokens], source)
                entry = CacheEntry(prefix, cached, unsigned=unsigned)
                self._entries[key] = entry
            else:
                # One copy of a shared prefix for all its readers; its reads from now on go
                # through the latest reader's client (its quota, shares and audit), never a
                # first reader's, whose token may since have been rotated or removed.
                entry.prefix.source.client = client
            self._entries.move_to_end(key)
            entry.users += 1
            self._evict()
        return entry

    def _local(self, tokens: list[int], cancelled: Callable[[], bool]) -> CacheEntry:
        """No cached prefix: prefill it here (held locally, not stored), once the budget
        has room for its KV; that reservation goes with the request to its admission."""
        need = prefill_bytes(self.runner.config, len(tokens))
        limit = self.budget.limit
        if limit is not None and need > limit:
            raise OverBudget(
                f"the prompt's KV needs {need} bytes but the decoder's budget is {limit} bytes"
            )

        def prefill() -> Prefix | None:  # on the model thread, between engine steps
            if not self.budget.try_reserve(need):
                return None
            try:
                return prefill_prefix(self.runner, tokens, 128)
            except BaseException:
                self.budget.release(need)
                raise

        while (prefix := self.model.call(prefill)) is None:
            if cancelled():
                raise Cancelled("the request was cancelled while waiting for room")
            time.sleep(LOCAL_PREFILL_POLL_S)  # requests in flight free their bytes
        return CacheEntry(prefix, None, users=1, prepaid=need)

    def _release(self, entry: CacheEntry) -> None:
        with self._lock:
            entry.users -= 1
            if entry.cached is None:  # a local prefill: nobody else has it
                self._forget(entry)
            self._evict()

    def _evict(self) -> None:
        idle = [k for k, e in self._entries.items() if e.users == 0]
        for key in idle[: max(0, len(self._entries) - self.capacity)]:
            self._forget(self._entries.pop(key))

    def _forget(self, entry: CacheEntry) -> None:
        """An entry leaves the cache: the bytes it holds go back to the budget."""
        self.budget.release(entry.charged + entry.prepaid)
        entry.charged = entry.prepaid = 0

    def _reclaim_idle(self) -> bool:
        """The budget's reclaimer: drop the least recently used idle cached prefix."""
        with self._lock:
            key = next((k for k, e in self._entries.items() if e.users == 0), None)
            if key is None:
                return False
            self._forget(self._entries.pop(key))
            return True

    def entries(self) -> list[CacheEntry]:
        with self._lock:
            return list(self._entries.values())

    def figures(self) -> CacheFigures:
        with self._lock:
            idle = sum(e.charged for e in self._entries.values() if e.users == 0)
            return CacheFigures(idle, len(self._entries))

    def clients_in_use(self) -> list[StoreClient]:
        """The clients cached prefixes read through (not closed while cached)."""
        with self._lock:
            return [e.prefix.source.client for e in self._entries.values() if e.cached is not None]

    # -- artifacts ----------------------------------------------------------------------------

    def artifacts(self, entry: CacheEntry, client: StoreClient) -> EntryArtifacts:
        """Where a request over `entry` gets the prefix's compressed KV, as the caller
        `client` (its quota pays, its role must let it write): the engine loads it only when
        the request's group drafts over it (`Request.artifacts`)."""
        return EntryArtifacts(self, entry, client)

    def load_artifact(self, entry: CacheEntry, spec: str, client: StoreClient) -> CompressedKV:
        """The prefix's compressed KV for `spec`, fetched, or built here and stored; on the
        model thread (the engine's), neither kept nor charged.

        Only an artifact signed by this deployment's decoders is fetched (another is as
        good as missing: docs/DESIGN.md section 8).

        A fetched artifact is used only if it fits this model and prefix (`validate`: layers,
        heads, dims, dtypes, length, positions). One that does not (any writer of the prefix
        may have stored it) is treated as missing: logged, never kept, rebuilt here from the
        full KV (always correct) and stored in its place, so the request is served as on a
        miss instead of failing, and no later request or worker meets it again."""
        compressed = self._fetch(entry, spec, client)
        if compressed is None:
            compressed = self._build(entry, spec)
            if entry.cached is not None:
                signer = None if entry.unsigned else self.signer
                self._store(client, entry.cached, spec, compressed, signer)
        return compressed

    @staticmethod
    def keep_artifact(entry: CacheEntry, spec: str, compressed: CompressedKV) -> None:
        """Keep an artifact with the entry for later requests; its bytes, which the caller
        reserved, are released with the entry."""
        with entry.lock:
            entry.charged += compressed.nbytes
            entry.prefix.artifacts[spec] = compressed

    def _fetch(self, entry: CacheEntry, spec: str, client: StoreClient) -> CompressedKV | None:
        """The stored artifact, when there is a signed one that fits; else None."""
        if entry.cached is None:
            return None
        data = client.fetch_artifact(entry.cached, spec, self.signer.verifier)
        try:
            if data is not None:
                compressed = from_bytes(data)
                validate(compressed, self.layout, entry.prefix.source.length, spec)
                return compressed
        except ArtifactFormatError as error:
            log.warning("stored artifact %s is unusable (%s); rebuilding it", spec, error)
        return None

    def _build(self, entry: CacheEntry, spec: str) -> CompressedKV:
        """The prefix's compressed KV for `spec`, from what its prefill observed when that
        covers the compressor's window (else the window is observed again, exactly).

        A stored prefix whose full KV cannot be read any more (evicted or deleted since the
        lookup, its shards gone) is recomputed here, exactly, as on a miss: the request is
        served, never failed NOT_FOUND (the engine does the same for its own reads)."""
        pipeline = parse_compressor(spec)
        try:
            return compress_observing(self.runner, pipeline, entry.prefix, self._held)
        except StoreError as error:
            if entry.cached is None:
                raise
            log.warning("a cached prefix's full KV is unreadable (%s); recomputing it", error)
            return self._build_recomputed(pipeline, entry.prefix)

    def _build_recomputed(self, pipeline: CompressorPipeline, prefix: Prefix) -> CompressedKV:
        """`_build` over the prefix's KV recomputed here (transient, budgeted)."""
        with self._held(prefill_bytes(self.runner.config, prefix.source.length)):
            local = prefill_prefix(self.runner, prefix.tokens, pipeline.observe_window)
            return compress_observing(self.runner, pipeline, local, self._held)

    @contextmanager
    def _held(self, nbytes: int) -> Iterator[None]:
        """`nbytes` of the budget, reserved (waiting for room) while the block runs."""
        self.budget.reserve(nbytes)
        try:
            yield
        finally:
            self.budget.release(nbytes)

    @staticmethod
    def _store(client, cached: CachedPrefix, spec: str, compressed, signer) -> None:
        """Store a built artifact for later requests and workers, as the caller (signed with
        `signer` when given); a caller that may not (a reader, over quota) still gets its
        tokens."""
        try:
            client.put_artifact(cached, spec, to_bytes(compressed), signer=signer)
        except StoreError as error:
            log.info("artifact %s not stored for later requests: %s", spec, error)
