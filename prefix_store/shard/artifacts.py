"""Artifacts: one blob of bytes per (prefix, spec, layout) (a compressor's draft state),
stored, replaced and read with their provenance. A signed artifact is never replaced by
an unsigned one."""

from __future__ import annotations

from prefix_store.blob import Blob
from prefix_store.errors import InvalidArgument, NotFound, StoreFull
from prefix_store.layout import KVLayout
from prefix_store.namespace import Namespace
from prefix_store.provenance import (
    PROOF_FORMAT,
    Proof,
    Verifier,
    artifact_statement,
)
from prefix_store.shard.arrival import ArrivalCheck
from prefix_store.shard.blobs import artifact_id, is_signed, proof_of
from prefix_store.shard.holdings import Holdings
from prefix_store.shard.puts import check_signature
from prefix_store.shard.reads import Reader
from prefix_store.shard.usage import QuotaCheck, check_quota


class ArtifactRead:
    """An artifact to be sent over the data plane, not leased (a put may replace it and
    eviction move it meanwhile, never waiting for a reader): its stored CRC-32C, size and
    provenance now; `data()` reads it from its tier when the transfer runs (`Unavailable`
    when it was replaced or evicted since), and `check(crc)`, with the CRC-32C of the bytes
    sent, fails with `DataLoss` when they differ, dropping it if it is still the one
    stored."""

    def __init__(self, reader: Reader, blob: Blob) -> None:
        self.reader, self.blob = reader, blob
        self.crc, self.proof, self.size = blob.crcs[0], proof_of(blob), blob.nbytes

    def data(self) -> bytes | memoryview:
        return self.reader.stored(self.blob, 0)

    def check(self, crc: int) -> None:
        self.reader.check(self.blob, 0, crc)


class Artifacts:
    """Thread-safe (the holdings' lock)."""

    def __init__(self, holdings: Holdings, reader: Reader, verifier: Verifier | None) -> None:
        self.holdings, self.reader, self.verifier = holdings, reader, verifier

    def put(
        self,
        namespace: Namespace,
        layout: KVLayout,
        prefix_key: int,
        prefix_tokens: int,
        spec: str,
        data: bytes,
        owner: str,
        quota: QuotaCheck,
        signature: bytes = b"",
        check: ArrivalCheck | None = None,
    ) -> int:
        """Store (or replace) an artifact; a signed one is never replaced by an unsigned one.
        Returns its bytes. `check`: its CRC-32C and digest, computed as it arrived (one
        layer of `len(data)` bytes); else computed here."""
        if check is None:
            check = ArrivalCheck(1, len(data))
            check.arrived(0, memoryview(data), memoryview(data))
        digest = check.digest()
        statement = artifact_statement(layout, prefix_key, prefix_tokens, spec, digest)
        signed = check_signature(self.verifier, statement, signature, "id.signature")
        blob = Blob(
            id=artifact_id(namespace, layout, prefix_key, spec),
            layout=layout,
            owner=owner,
            tokens=(prefix_tokens,),
            segment_bytes=len(data),
            crcs=tuple(check.crcs),
            data=(data,),
            meta={
                "digest": digest.hex(),
                "signature": signature.hex(),
                "signed": signed,
                "proof": PROOF_FORMAT,
            },
        )
        allowance = quota(owner)
        holdings = self.holdings
        with holdings.mutating() as failed:
            holdings.leases.refuse_doomed([blob])
            old = holdings.placement.find(blob.id)
            self._check_replace(blob, old, spec, prefix_key)
            freed = old.nbytes if old is not None else 0
            own_freed = freed if old is not None and old.owner == owner else 0
            check_quota(holdings.stats.usage, owner, allowance, max(0, blob.nbytes - own_freed))
            if not holdings.placement.room_for(blob.nbytes - freed):
                raise StoreFull(f"shard {holdings.shard_id}: no room for {blob.nbytes} bytes")
            if old is not None:
                holdings.drop(blob.id)
            holdings.place(blob)
            holdings.stats.received_bytes += blob.nbytes
            holdings.stats.stored_bytes += blob.nbytes
        holdings.settle_change(failed, [blob])
        return blob.nbytes

    def _check_replace(self, blob: Blob, old: Blob | None, spec: str, prefix_key: int) -> None:
        """Whether `blob` may replace `old` (InvalidArgument: unsigned over signed;
        Unavailable: the old one is being read)."""
        if old is None:
            return
        if is_signed(old) and not is_signed(blob):
            raise InvalidArgument(
                f"artifact {spec!r} of prefix {prefix_key:016x}: a signed artifact is "
                "stored; an unsigned one cannot replace it"
            )
        self.holdings.leases.refuse_leased([blob.id])

    def open_read(
        self, namespace: Namespace, layout: KVLayout, prefix_key: int, spec: str
    ) -> ArtifactRead:
        """The artifact, for a transfer that reads and checks it as it sends it (NotFound:
        not here)."""
        blob = self.reader.current(artifact_id(namespace, layout, prefix_key, spec))
        if blob is None:
            raise NotFound(f"artifact {spec!r} of prefix {prefix_key:016x} is not stored here")
        return ArtifactRead(self.reader, blob)

    def fetch(
        self, namespace: Namespace, layout: KVLayout, prefix_key: int, spec: str
    ) -> tuple[bytes, int, Proof, int]:
        """The artifact's bytes (checked against its stored CRC-32C), its prefix length, its
        provenance and that CRC-32C (NotFound: not here)."""
        blob_id = artifact_id(namespace, layout, prefix_key, spec)
        blob = self.reader.lease(blob_id)
        if blob is None:
            raise NotFound(f"artifact {spec!r} of prefix {prefix_key:016x} is not stored here")
        try:
            return self.reader.segment(blob, 0), blob.tokens[0], proof_of(blob), blob.crcs[0]
        finally:
            self.reader.release([blob_id])
