"""Lookups: which chunks of a token sequence a shard holds, confirmed by their tokens, and
for the first it does not, the longest stored partial chunk that starts it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefix_store.blob import Blob
from prefix_store.config import ShardConfig
from prefix_store.errors import InvalidArgument
from prefix_store.keys import chunk_keys, parent_keys
from prefix_store.layout import KVLayout
from prefix_store.namespace import Namespace
from prefix_store.protocol.tokens import validate_tokens
from prefix_store.provenance import Proof
from prefix_store.shard.blobs import chunk_id, chunk_tokens, is_partial, proof_of

if TYPE_CHECKING:
    from prefix_store.shard.holdings import Holdings


@dataclass(frozen=True, slots=True)
class LookupResult:
    keys: list[int]
    """Keys of every chunk of the looked-up tokens (the last may be partial)."""
    present: list[int]
    """Requested chunk indices held here as full chunks, confirmed by their tokens."""
    partial_index: int = 0
    partial_tokens: int = 0
    partial_key: int = 0
    cached_tokens: int = 0
    proofs: list[Proof] = field(default_factory=list)
    """One per `present` entry."""
    partial_proof: Proof = Proof()


class PartialChunks:
    """The keys of the partial chunks held, by (namespace id, parent key): where a lookup
    looks for the longest one that starts a chunk. Under the holdings' lock."""

    def __init__(self) -> None:
        self._keys: defaultdict[tuple[str, int], set[int]] = defaultdict(set)

    def __len__(self) -> int:
        return len(self._keys)

    def under(self, namespace: Namespace, parent: int) -> set[int] | tuple[()]:
        """Keys of the partial chunks that follow the chunk `parent` in `namespace`."""
        return self._keys.get((namespace.id, parent), ())

    def add(self, blob: Blob) -> None:
        if is_partial(blob):
            self._keys[(blob.namespace, blob.meta["parent"])].add(blob.id[2])

    def discard(self, blob: Blob) -> None:
        if not is_partial(blob):
            return
        where = (blob.namespace, blob.meta["parent"])
        keys = self._keys.get(where)
        if keys is not None:
            keys.discard(blob.id[2])
            if not keys:
                del self._keys[where]


def lookup(
    config: ShardConfig,
    holdings: Holdings,
    namespace: Namespace,
    layout: KVLayout,
    token_ids: Sequence[int],
    indices: Sequence[int] = (),
) -> LookupResult:
    """As `Shard.lookup`."""
    config.layouts.check(layout)
    ids = validate_tokens(token_ids, limit=config.max_tokens)
    keys = chunk_keys(ids, layout, namespace.salt)
    if len(indices) > len(keys):
        raise InvalidArgument(f"chunk_indices: more than the {len(keys)} chunks")
    parents = parent_keys(keys, layout, namespace.salt)
    wanted = sorted(set(indices)) if indices else list(range(len(keys)))
    if wanted and (wanted[0] < 0 or wanted[-1] >= len(keys)):
        raise InvalidArgument(f"chunk_indices: must be in [0, {len(keys)})")
    present, proofs, partial, partial_proof = [], [], (0, 0, 0), Proof()
    with holdings.lock:
        for index in wanted:
            blob = _held_full(holdings, namespace, layout, ids, keys, index)
            if blob is not None:
                present.append(index)
                proofs.append(proof_of(blob))
                continue
            partial = _longest_partial(holdings, namespace, layout, ids, parents, index)
            if partial[1]:
                partial_proof = proof_of(holdings.read_live(chunk_id(namespace, partial[2])))
            break
        holdings.stats.hits += len(present)
        holdings.stats.misses += len(wanted) - len(present)
    leading = 0
    if not indices:
        leading = len(present) * layout.chunk_tokens if present == wanted[: len(present)] else 0
        leading += partial[1]
    return LookupResult(keys, present, *partial, leading, proofs, partial_proof)


def _held_full(holdings: Holdings, namespace, layout, ids, keys, index) -> Blob | None:
    tokens = chunk_tokens(ids, layout, index)
    if len(tokens) < layout.chunk_tokens:
        return None
    blob = holdings.find_live(chunk_id(namespace, keys[index]))
    if not _matches(blob, layout, tokens):
        return None
    return holdings.read_live(blob.id)


def _matches(blob: Blob | None, layout: KVLayout, tokens: list[int]) -> bool:
    return blob is not None and blob.layout == layout and list(blob.tokens) == tokens


def _longest_partial(holdings: Holdings, namespace, layout, ids, parents, index):
    """(index, tokens, key) of the longest partial chunk held that starts chunk `index`
    ((index, 0, 0): none)."""
    want = chunk_tokens(ids, layout, index)
    best = (index, 0, 0)
    for key in holdings.partials.under(namespace, parents[index]):
        blob = holdings.find_live(chunk_id(namespace, key))
        n = len(blob.tokens) if blob is not None else 0
        if n > best[1] and _matches(blob, layout, want[:n]) and n <= len(want):
            best = (index, n, key)
    return best
