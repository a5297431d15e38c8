"""The client SDK of the prefix store (sync and asyncio)."""

from prefix_store.client.aio import AsyncStoreClient
from prefix_store.client.aio_attention import AsyncAttentionSession
from prefix_store.client.arriving import Arriving
from prefix_store.client.core import PublishResult
from prefix_store.client.loops import quiet_grpc_wakeups
from prefix_store.client.near_data import AttentionSession
from prefix_store.client.plan import CachedPrefix, ChunkPlan, Topology, rendezvous
from prefix_store.client.sync import FetchHandle, StoreClient

__all__ = [
    "Arriving",
    "AsyncAttentionSession",
    "AsyncStoreClient",
    "AttentionSession",
    "CachedPrefix",
    "ChunkPlan",
    "FetchHandle",
    "PublishResult",
    "StoreClient",
    "Topology",
    "quiet_grpc_wakeups",
    "rendezvous",
]
