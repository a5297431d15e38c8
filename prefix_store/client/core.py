"""The store client's policy, once for both shells (`StoreClient` on threads,
`AsyncStoreClient` on asyncio): where each call and stream goes, what a failure means
(fail over to a replica, quarantine the shard, refresh the membership, or fail), which
deadline applies, how a publish settles and what its undo deletes. No I/O: the shells make
the calls, then report what happened and do what the core answers.

Failures: UNAVAILABLE (a shard unreachable, a dead socket) quarantines the shard for
`ClientConfig.quarantine_s` and makes a membership refresh due; calls retry it with backoff
(`retry.Attempts`) through the candidates, healthy ones first. A fetch stream that fails
with UNAVAILABLE, DATA_LOSS (corrupt at rest or in transit) or NOT_FOUND continues from its
first incomplete layer on the next replica of its chunks; with no replica left the fetch
fails NotFound when every copy was missing or corrupt, else Unavailable. Every other
status fails the call at once. Thread-safe.

What a client met is counted (`ClientCore.events`, `StoreClient.events()`): shards found
unreachable, and fetch failovers by their cause (`failover.Unavailable`,
`failover.DataLoss`, `failover.CorruptInTransit`, `failover.NotFound`, ...). They are
figures for the application and for chaos runs' evidence, never data.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import grpc
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.client.arriving import Arriving
from prefix_store.client.membership import Membership, Quarantine
from prefix_store.client.plan import (
    ArtifactReceipt,
    Assembly,
    CachedPrefix,
    ChunkPlan,
    Settled,
    Topology,
    artifact_id,
    artifact_statement_of,
    as_layers,
    cached_prefix,
    fetch_request,
    group_by_owner,
    held_chunks,
    lanes,
    lookup_request,
    placement,
    plan_chunks,
    put_header,
    put_messages,
    settle,
    signed_chunks,
)
from prefix_store.client.retry import Attempts, backoff, busy_wait_s, rpc_error
from prefix_store.config import ClientConfig
from prefix_store.errors import (
    DataLoss,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    StoreError,
    Unavailable,
)
from prefix_store.layout import KVLayout
from prefix_store.protocol.tokens import validate_tokens
from prefix_store.provenance import Signer, Verifier
from prefix_store.status import FAILOVER

log = logging.getLogger("prefix_store.client")


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Every deadline a client sets, from its `ClientConfig`: one set for both shells."""

    call: float
    """Unary calls (Describe, Lookup, Delete, Stats): `timeout_s`."""
    stream: float
    """Put, Fetch and artifact streams, data-plane puts, a layer's wait: `stream_timeout_s`."""
    idle: float
    """Ticket calls (OpenPut, OpenFetch), data-plane fetch sockets and Attend answers: a
    shard that stays silent this long is lost and its replica takes over: `idle_timeout_s`."""

    @classmethod
    def of(cls, config: ClientConfig) -> Deadlines:
        return cls(config.timeout_s, config.stream_timeout_s, config.idle_timeout_s)


@dataclass(frozen=True, slots=True)
class PublishResult:
    prefix: CachedPrefix
    stored_bytes: int
    """Bytes newly stored, replicas included (chunks already present cost nothing)."""
    missing_replicas: int
    """Chunk copies that could not be placed (their shard was down); each chunk has >= 1."""


@dataclass(frozen=True, slots=True)
class LookupCall:
    shard_id: str
    """The owner asked (the attempts go on to the chunks' other owners if it is down)."""
    attempts: Attempts
    request: pb.LookupRequest
    chunks: list[ChunkPlan]


@dataclass(slots=True)
class Lookup:
    """A lookup, in rounds (`ClientCore.plan_lookup`, then `ClientCore.answered` per round
    until `calls` is empty). The first round asks each chunk's best owner. An owner may lack
    a chunk that a replica still holds (a restart lost its memory tier, a corrupt copy was
    dropped, an eviction), so each later round makes one call: the first chunk not yet found
    whole, with the later ones not found, to an owner of it that has not answered for it.
    It ends when every chunk is found or that first chunk's owners have all answered: a
    cold miss costs one more call per further replica. A later round's call is tried once
    (its failure answers nothing; the shard is quarantined as usual)."""

    namespace: str
    layout: KVLayout
    ids: list[int]
    chunks: list[ChunkPlan]
    calls: list[LookupCall] = field(default_factory=list)
    """This round's calls; empty once the lookup is done."""
    rounds: int = 0
    found: dict[int, ChunkPlan] = field(default_factory=dict)
    """Chunk index -> the most of it an owner holds (whole, or a partial chunk)."""
    answered: dict[int, set[str]] = field(default_factory=dict)
    """Chunk index -> the owners that said whether they hold it."""

    def result(self) -> CachedPrefix:
        """The cached prefix found so far (all of it once `calls` is empty)."""
        return cached_prefix(self.namespace, self.layout, self.chunks, self.found)

    def first_missing(self) -> ChunkPlan | None:
        """The first chunk not found whole."""
        return next((c for c in self.chunks if not self.whole(c)), None)

    def whole(self, chunk: ChunkPlan) -> bool:
        held = self.found.get(chunk.index)
        return held is not None and held.tokens >= chunk.tokens

    def take(self, call: LookupCall, response: pb.LookupResponse | StoreError) -> None:
        """One call's answer (a failed call answers nothing it was asked)."""
        if isinstance(response, StoreError):
            held, answered = {}, {c.index for c in call.chunks}
        else:
            held, answered = held_chunks(call.chunks, response)
        for index in answered:
            self.answered.setdefault(index, set()).add(call.shard_id)
        for index, chunk in held.items():
            before = self.found.get(index)
            if before is None or chunk.tokens > before.tokens:
                self.found[index] = chunk


@dataclass(frozen=True, slots=True)
class PutStream:
    shard_id: str
    lane: int
    chunks: list[ChunkPlan]
    address: str
    data_address: str | None
    """The shard's data plane when the put goes over it; None: a gRPC Put stream."""


@dataclass(frozen=True, slots=True)
class Publish:
    """A planned publish: what goes where."""

    namespace: str
    layout: KVLayout
    ids: list[int]
    layers: list
    """Per layer (k, v) byte rows (`plan.as_layers`)."""
    chunks: list[ChunkPlan]
    streams: list[PutStream]

    def header(self, stream: PutStream) -> pb.PutHeader:
        return put_header(self.namespace, self.layout, self.ids, stream.chunks)

    def messages(self, stream: PutStream, message_bytes: int) -> Iterator[bytes]:
        return put_messages(
            self.namespace, self.layout, self.ids, stream.chunks, self.layers, message_bytes
        )


@dataclass(frozen=True, slots=True)
class FetchStream:
    shard_id: str
    lane: int
    chunks: list[ChunkPlan]
    failed: frozenset[str]
    """Shards this stream's chunks already failed on."""
    request: pb.FetchRequest
    address: str
    data_address: str | None
    """The shard's data plane when the stream goes over it; None: a gRPC Fetch stream."""
    busy: frozenset[str] = frozenset()
    """Shards that refused this stream's chunks as busy in this round (not quarantined)."""
    rounds: int = 0
    """Rounds in which every owner of the chunks refused them as busy (at most `retries`)."""
    delay_s: float = 0.0
    """How long the stream waits before it starts (backing off after a busy round)."""


def failover_error(error: BaseException) -> StoreError | None:
    """The typed error of a failed fetch stream if another replica may succeed, else None."""
    if isinstance(error, grpc.RpcError):
        return rpc_error(error) if error.code() in FAILOVER else None
    if isinstance(error, Unavailable | DataLoss | NotFound):
        return error
    return None


def typed(error: BaseException) -> BaseException:
    return rpc_error(error) if isinstance(error, grpc.RpcError) else error


def artifact_placement(prefix_key: int, spec: str) -> int:
    """The placement key of a prefix's artifact of one compressor spec."""
    digest = hashlib.blake2b(prefix_key.to_bytes(8, "big") + spec.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big")


def exhausted(error: NotFound, failed: frozenset, cause: StoreError | None) -> StoreError:
    """The error of a fetch that ran out of replicas: a miss (NOT_FOUND, or corrupt
    everywhere) stays a miss; otherwise the shards were unavailable."""
    detail = f"fetch: {error} (tried {', '.join(sorted(failed))})"
    if isinstance(cause, NotFound | DataLoss):
        return NotFound(f"{detail}: {cause}")
    return Unavailable(f"{detail}: {cause}" if cause else detail)


class ClientCore:
    """The policy state of one client: its membership view, quarantine and refresh clock."""

    def __init__(self, endpoints: str | Sequence[str], config: ClientConfig | None) -> None:
        self.config = config or ClientConfig()
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise InvalidArgument("endpoints: at least one host:port is required")
        self.deadlines = Deadlines.of(self.config)
        self._membership = Membership(self.config.membership_grace_s)
        self._quarantine = Quarantine(self.config)
        self._lock = threading.Lock()
        self._refreshed = -math.inf
        self._due = -math.inf
        self._events: Counter[str] = Counter()
        self._once = replace(self.config, retries=1)

    def count(self, event: str) -> None:
        """Record that this client met `event` (see the module's docstring)."""
        with self._lock:
            self._events[event] += 1

    def events(self) -> dict[str, int]:
        """What this client met since it was made, by event."""
        with self._lock:
            return dict(self._events)

    @property
    def topology(self) -> Topology | None:
        return self._membership.topology

    # ---- membership -----------------------------------------------------------------------

    def describe_attempts(self) -> Attempts:
        """Describe's targets: the endpoints, then every shard known."""
        known = list(self.topology.shards.values()) if self.topology else []
        return Attempts(self.config, list(dict.fromkeys(self.endpoints + known)))

    def claim_refresh(self, now: float | None = None) -> bool:
        """Whether the caller should refresh the membership now (one caller at a time)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now < self._due:
                return False
            self._refreshed, self._due = now, now + self.config.refresh_s
            return True

    def observe(self, response: pb.DescribeResponse, now: float | None = None) -> Topology:
        """The topology after a Describe answered `response` (see `client.membership`)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            before = dict(self.topology.shards) if self.topology else {}
            self._refreshed = now
            self._due = now + self.config.refresh_s
            topology = self._membership.observe(Topology.from_proto(response), now)
            change = self._membership.next_change()
            if change is not None:
                self._due = min(self._due, max(change, now + self.config.min_refresh_s))
        for shard_id, address in topology.shards.items():
            if before.get(shard_id, address) != address:
                self._quarantine.clear(shard_id)  # restarted: its failure was the old one's
        return topology

    def refresh_done(self, outcome: Topology | StoreError) -> None:
        """A refresh's outcome: a failed one leaves the last topology standing."""
        if isinstance(outcome, StoreError):
            log.warning("membership refresh failed (the last one stands): %s", outcome)

    def failed(self, shard_id: str, now: float | None = None) -> None:
        """A shard was unreachable: quarantine it, and refresh the membership soon."""
        now = time.monotonic() if now is None else now
        self._quarantine.add(shard_id, now)
        with self._lock:
            self._events["unreachable"] += 1
            self._due = min(self._due, self._refreshed + self.config.min_refresh_s)

    def suspects(self, now: float | None = None) -> frozenset[str]:
        """Shards that failed within the last `quarantine_s`."""
        return self._quarantine.active(time.monotonic() if now is None else now)

    def avoided(self) -> frozenset[str]:
        """Shards calls route around while a replica is left: suspects and absent ones."""
        return self.suspects() | self.topology.absent

    def healthy_first(self, shard_ids: Sequence[str]) -> list[str]:
        avoided = self.avoided()
        return sorted(shard_ids, key=lambda shard_id: shard_id in avoided)

    def attempts(self, shard_ids: Sequence[str], wait_when_busy: bool = False) -> Attempts:
        """A call's attempts on these shards, healthy ones first; UNAVAILABLE quarantines
        (`wait_when_busy`: see `Attempts`)."""
        return Attempts(self.config, self.healthy_first(shard_ids), self.failed, wait_when_busy)

    def address(self, shard_id: str) -> str:
        """The shard's address; Unavailable when it has left the membership since the
        call's attempts were planned (a refresh on another thread in between), so that the
        call moves on to the next target as from an unreachable shard."""
        address = self.topology.shards.get(shard_id)
        if address is None:
            raise Unavailable(f"{shard_id} left the membership since the call was planned")
        return address

    def groups(self, chunks: Sequence[ChunkPlan], failed: frozenset) -> dict[str, list]:
        """Chunks by best owner not in `failed`, leaving out avoided shards where a replica
        is; NotFound when some chunk has no owner left."""
        try:
            return group_by_owner(chunks, self.topology, failed | self.avoided())
        except NotFound:
            return group_by_owner(chunks, self.topology, failed)

    # ---- lookup ---------------------------------------------------------------------------

    def plan_lookup(self, tokens, layout: KVLayout, namespace: str) -> Lookup:
        """A lookup's first round: one call per best owner, each with its attempts over the
        chunks' owners (see `Lookup`)."""
        ids = validate_tokens(tokens)
        chunks = plan_chunks(ids, layout, self.topology.salt(namespace))
        lookup = Lookup(namespace, layout, ids, chunks)
        for shard_id, group in self.groups(chunks, frozenset()).items():
            others = [s for s in self.topology.owners(group[0].parent) if s != shard_id]
            attempts = Attempts(self.config, [shard_id, *self.healthy_first(others)], self.failed)
            lookup.calls.append(self._lookup_call(lookup, shard_id, attempts, group))
        return lookup

    def answered(self, lookup: Lookup, responses: Sequence[pb.LookupResponse | StoreError]) -> None:
        """A round's responses (in `lookup.calls` order; the StoreError of a failed call):
        the first round's failure fails the lookup; a later one's answers nothing, and the
        lookup returns what the others found. Plans the next round into `lookup.calls`."""
        if lookup.rounds == 0:
            for response in responses:
                if isinstance(response, StoreError):
                    raise response
        for call, response in zip(lookup.calls, responses, strict=True):
            lookup.take(call, response)
        lookup.rounds += 1
        lookup.calls = self._next_lookup_call(lookup)

    def _next_lookup_call(self, lookup: Lookup) -> list[LookupCall]:
        first = lookup.first_missing()
        if first is None:
            return []
        avoided = self.avoided()

        def unasked(chunk: ChunkPlan) -> list[str]:
            skip = lookup.answered.get(chunk.index, set()) | avoided
            return [s for s in self.topology.owners(chunk.parent) if s not in skip]

        candidates = unasked(first)
        if not candidates:
            return []
        shard_id = candidates[0]
        chunks = [
            c
            for c in lookup.chunks[first.index :]
            if not lookup.whole(c) and shard_id in unasked(c)
        ]
        once = Attempts(self._once, [shard_id], self.failed)  # a later round never retries
        return [self._lookup_call(lookup, shard_id, once, chunks)]

    def _lookup_call(self, lookup: Lookup, shard_id: str, attempts, chunks) -> LookupCall:
        request = lookup_request(lookup.ids, lookup.layout, lookup.namespace, chunks)
        return LookupCall(shard_id, attempts, request, chunks)

    def delete_request(self, tokens, layout: KVLayout, namespace: str) -> pb.DeleteRequest:
        return pb.DeleteRequest(
            namespace=namespace, layout=layout.to_proto(pb), token_ids=validate_tokens(tokens)
        )

    # ---- publish --------------------------------------------------------------------------

    def plan_publish(
        self, tokens, kv, layout: KVLayout, namespace: str, signer: Signer | None
    ) -> Publish:
        """Every chunk to every listed owner, on `ClientConfig.streams` streams."""
        ids = validate_tokens(tokens)
        if not ids:
            raise InvalidArgument("tokens: at least one token is required")
        layers = as_layers(kv, layout, len(ids))
        chunks = plan_chunks(ids, layout, self.topology.salt(namespace))
        if signer is not None:
            chunks = signed_chunks(signer, layout, ids, chunks, layers)
        return Publish(namespace, layout, ids, layers, chunks, self._put_streams(chunks))

    def _put_streams(self, chunks: list[ChunkPlan]) -> list[PutStream]:
        topology = self.topology
        groups = {
            shard_id: part
            for shard_id, part in placement(chunks, topology).items()
            if shard_id not in topology.absent  # known gone: its copies are missing replicas
        }
        return [
            PutStream(s, lane, part, topology.shards[s], self.data_address(s))
            for s, lane, part in lanes(groups, self.config.streams)
        ]

    def settle(self, publish: Publish, outcomes: list[tuple[PutStream, object]]) -> Settled:
        """outcomes: (stream, PutResponse or the StoreError it raised)."""
        for stream, outcome in outcomes:
            if isinstance(outcome, StoreError):
                log.warning("publish: shard %s failed: %s", stream.shard_id, outcome)
        return settle(
            publish.chunks,
            [(s.shard_id, s.chunks, outcome) for s, outcome in outcomes],
            self.topology.replication,
        )

    def undo(self, publish: Publish, settled: Settled) -> list[tuple[str, pb.DeleteRequest]]:
        """The deletes that undo a failed publish: what its committed streams stored (the
        shell runs each and reports to `undone`)."""
        if settled.error is None:
            return []
        return [
            (shard_id, pb.DeleteRequest(namespace=publish.namespace, chunk_keys=keys))
            for shard_id, keys in settled.done
            if keys
        ]

    def undone(self, shard_id: str, request: pb.DeleteRequest, outcome) -> None:
        """An undo's outcome (a DeleteResponse or the StoreError it raised); best effort:
        chunks left behind are valid data."""
        if isinstance(outcome, StoreError):
            count = len(request.chunk_keys)
            log.warning("publish: could not undo %d chunks on %s: %s", count, shard_id, outcome)

    def published(self, publish: Publish, settled: Settled) -> PublishResult:
        """The publish's result, or its error (after the shell ran `undo`)."""
        if settled.error is not None:
            raise settled.error
        chunks = tuple(publish.chunks)
        prefix = CachedPrefix(
            publish.namespace, publish.layout, sum(c.tokens for c in chunks), chunks
        )
        return PublishResult(prefix, settled.stored_bytes, settled.missing_replicas)

    # ---- fetch ----------------------------------------------------------------------------

    def fetch_route(
        self, prefix: CachedPrefix, k_out, v_out, layer_start: int, layer_end: int | None
    ) -> FetchRoute:
        layer_end = prefix.layout.num_layers if layer_end is None else layer_end
        if not 0 <= layer_start < layer_end <= prefix.layout.num_layers:
            raise InvalidArgument(f"layers: [{layer_start}, {layer_end}) out of range")
        if not prefix.chunks:
            raise NotFound("fetch: the prefix has no cached chunks")
        return FetchRoute(self, Assembly(prefix, k_out, v_out, layer_start, layer_end))

    def data_address(self, shard_id: str, direct: bool = True) -> str | None:
        if not (self.config.data_plane and direct):
            return None
        return self.topology.data_addresses.get(shard_id)

    # ---- artifacts ------------------------------------------------------------------------

    def artifact_id(
        self, prefix: CachedPrefix, spec: str, data: bytes, signer: Signer | None
    ) -> pb.ArtifactId:
        """The id a put_artifact sends, signed by `signer` when given (over all the bytes:
        an `Arriving` buffer is waited for first)."""
        signature = b""
        if signer is not None:
            if isinstance(data, Arriving):
                data.wait(data.nbytes)
                data = data.buffer
            signature = signer.sign(artifact_statement_of(prefix, spec, data))
        return artifact_id(prefix, spec, signature)

    def artifact_owners(self, prefix: CachedPrefix, spec: str) -> list[str]:
        return self.healthy_first(self.topology.owners(artifact_placement(prefix.key, spec)))

    def artifact_data_plane(self, owners: Sequence[str]) -> dict[str, str] | None:
        """Each owner's data-plane address when every owner has one: the artifact then
        moves over the data plane, its put in two phases (`artifact_refusal`); None: over
        gRPC."""
        addresses = {s: self.data_address(s) for s in owners}
        return addresses if owners and None not in addresses.values() else None

    @staticmethod
    def artifact_refusal(outcomes: list) -> BaseException | None:
        """What refuses a two-phase put_artifact before any byte moves (outcomes: each
        owner's ticket or error): any error but UNAVAILABLE, or UNAVAILABLE from every
        owner. The owners that granted a ticket then give it back, so none stores it."""
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        fatal = [e for e in errors if not isinstance(e, Unavailable)]
        if fatal or len(errors) == len(outcomes):
            return (fatal or errors)[0]
        return None

    def artifact_stored(self, outcomes: list) -> int:
        """Bytes a put_artifact stored (outcomes: stored bytes or the error of each owner);
        it fails when no owner took it, or with any error but UNAVAILABLE."""
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        fatal = [e for e in errors if not isinstance(e, Unavailable)]
        if fatal or len(errors) == len(outcomes):
            raise (fatal or errors)[0]
        return sum(o for o in outcomes if not isinstance(o, BaseException))

    def artifact_search(
        self, prefix: CachedPrefix, spec: str, verifier: Verifier | None
    ) -> ArtifactSearch:
        return ArtifactSearch(self, prefix, spec, verifier)

    def artifact_probe(self, prefix: CachedPrefix, spec: str) -> ArtifactProbe:
        return ArtifactProbe(self, prefix, spec)


class ArtifactSearch:
    """fetch_artifact's walk over an artifact's owners, healthy first, until one yields a
    copy: a miss, a corrupt copy, an unreachable owner or one whose data plane is at its
    bounds (LimitExceeded) moves on to the next; any other error is raised; a copy whose
    signature `verifier` rejects is passed over."""

    def __init__(
        self, core: ClientCore, prefix: CachedPrefix, spec: str, verifier: Verifier | None
    ) -> None:
        self.prefix, self.spec, self.verifier = prefix, spec, verifier
        self.owners = core.artifact_owners(prefix, spec)
        self.request = pb.FetchArtifactRequest(
            id=artifact_id(prefix, spec), max_message_bytes=core.config.message_bytes
        )
        self.found: bytes | None = None

    def __iter__(self) -> Iterator[str]:
        for shard_id in self.owners:
            if self.found is None:
                yield shard_id

    def take(self, shard_id: str, outcome: ArtifactReceipt | StoreError) -> None:
        """What reading from `shard_id` gave: its receipt, or the error it raised."""
        try:
            if isinstance(outcome, StoreError):
                raise outcome
            data = outcome.data()
        except (NotFound, DataLoss, Unavailable, LimitExceeded) as error:
            log.info("fetch_artifact: %s failed (%s); trying the next owner", shard_id, error)
            return
        if self.verifier is None or self.verifier.verify(
            artifact_statement_of(self.prefix, self.spec, data), outcome.signature
        ):
            self.found = data
        else:
            log.warning("artifact %s on %s is not signed by this deployment", self.spec, shard_id)


PROBE_MESSAGE_BYTES = 64 * 1024
"""has_artifact reads one FetchArtifact message of at most this size, then cancels."""


class ArtifactProbe:
    """has_artifact's walk over an artifact's owners, healthy first, until one holds it: a
    miss, a corrupt copy or an unreachable owner moves on; any other error is raised. An
    owner holds it when its FetchArtifact stream yields a first message."""

    def __init__(self, core: ClientCore, prefix: CachedPrefix, spec: str) -> None:
        self.owners = core.artifact_owners(prefix, spec)
        self.request = pb.FetchArtifactRequest(
            id=artifact_id(prefix, spec), max_message_bytes=PROBE_MESSAGE_BYTES
        )
        self.found = False

    def __iter__(self) -> Iterator[str]:
        for shard_id in self.owners:
            if not self.found:
                yield shard_id

    def take(self, shard_id: str, outcome: bool | StoreError) -> None:
        """What probing `shard_id` gave: whether it streamed a message, or its error."""
        if isinstance(outcome, NotFound | DataLoss | Unavailable | LimitExceeded):
            log.info("has_artifact: %s: %s", shard_id, outcome)
        elif isinstance(outcome, StoreError):
            raise outcome
        else:
            self.found = outcome


class FetchRoute:
    """One fetch's streams and failover, over the outputs in `assembly`. Thread-safe."""

    def __init__(self, core: ClientCore, assembly: Assembly) -> None:
        self.core = core
        self.assembly = assembly

    def start(self) -> list[FetchStream]:
        """The first streams: every chunk from its best owner."""
        return self._spread(list(self.assembly.prefix.chunks), self.assembly.layer_start)

    def failed(self, stream: FetchStream, error: BaseException) -> list[FetchStream]:
        """The streams that continue a failed one (none: the fetch failed or was closed)."""
        if self.assembly.closed:
            return []
        wait = busy_wait_s(error)
        if wait is not None:
            return self._busy(stream, typed(error), wait)
        cause = failover_error(error)
        if cause is None:
            self.assembly.fail(typed(error))
            return []
        log.warning("fetch: %s failed (%s); continuing from a replica", stream.shard_id, cause)
        self.core.count(f"failover.{type(cause).__name__}")
        if isinstance(cause, Unavailable):
            self.core.failed(stream.shard_id)
        resume = self.assembly.first_missing_layer(stream.chunks)
        return self._spread(stream.chunks, resume, stream.failed | {stream.shard_id}, cause)

    def _busy(self, stream: FetchStream, cause: StoreError, wait: float) -> list[FetchStream]:
        """A shard refused the stream by its bounds (busy, or the tenant over its share
        there): the chunks move to a replica that has not refused them (the shard is not
        quarantined: it is up); once every owner refused them, they go round again after a
        backoff of at least `wait`, at most `retries` rounds; then the fetch fails with the
        refusal (RESOURCE_EXHAUSTED naming the limit)."""
        log.info("fetch: %s refused a stream as busy (%s)", stream.shard_id, cause)
        resume = self.assembly.first_missing_layer(stream.chunks)
        busy = stream.busy | {stream.shard_id}
        try:
            self.core.groups(stream.chunks, stream.failed | busy)
        except NotFound:
            rounds = stream.rounds + 1
            if rounds >= self.core.config.retries:
                self.assembly.fail(cause)
                return []
            delay = max(wait, backoff(self.core.config, rounds))
            return self._spread(stream.chunks, resume, stream.failed, cause, (), rounds, delay)
        return self._spread(stream.chunks, resume, stream.failed, cause, busy, stream.rounds)

    def _spread(
        self,
        chunks: list,
        layer_from: int,
        failed: frozenset = frozenset(),
        cause=None,
        busy=frozenset(),
        rounds: int = 0,
        delay_s: float = 0.0,
    ) -> list[FetchStream]:
        """Streams for `chunks` from `layer_from` on their best owners not in `failed` (nor
        `busy`); when none is left, the fetch fails with what the last owner said."""
        try:
            groups = self.core.groups(chunks, failed | frozenset(busy))
        except NotFound as error:
            self.assembly.fail(exhausted(error, failed, cause))
            return []
        if layer_from >= self.assembly.layer_end or self.assembly.stopped:
            return []
        return [
            replace(
                self._stream(shard_id, lane, part, layer_from, failed),
                busy=frozenset(busy),
                rounds=rounds,
                delay_s=delay_s,
            )
            for shard_id, lane, part in lanes(groups, self.core.config.streams)
        ]

    def _stream(self, shard_id: str, lane: int, chunks, layer_from: int, failed) -> FetchStream:
        assembly = self.assembly
        request = fetch_request(
            assembly.prefix, chunks, layer_from, assembly.layer_end, self.core.config.message_bytes
        )
        return FetchStream(
            shard_id,
            lane,
            chunks,
            failed,
            request,
            self.core.address(shard_id),
            self.core.data_address(shard_id, assembly.direct),
        )
