"""A shard of the prefix store, by noun: the `Shard` facade (`shard`) over what it holds
(`holdings`: blobs placed in the tiers by `placement`, with their `leases`, `claims` and
`usage`), the puts it receives (`receiving`, `puts`), its `lookup`, `reads` (fetches and
the scrubber's checks), `artifacts` and `deletes`; `blobs` names what it stores."""

from prefix_store.shard.deletes import ANYONE, Deletable
from prefix_store.shard.lookup import LookupResult
from prefix_store.shard.puts import Committed, PutSession
from prefix_store.shard.reads import ChunkRef, FetchStream
from prefix_store.shard.receiving import Reservation
from prefix_store.shard.shard import Shard
from prefix_store.shard.usage import Allowance, QuotaCheck, ShardStats

__all__ = [
    "ANYONE",
    "Allowance",
    "ChunkRef",
    "Committed",
    "Deletable",
    "FetchStream",
    "LookupResult",
    "PutSession",
    "QuotaCheck",
    "Reservation",
    "Shard",
    "ShardStats",
]
