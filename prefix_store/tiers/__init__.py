"""Storage tiers of a shard: memory (LRU, byte capacity) spilling to disk (survives restarts)."""

from prefix_store.tiers.disk import DiskTier
from prefix_store.tiers.memory import MemoryTier

__all__ = ["DiskTier", "MemoryTier"]
