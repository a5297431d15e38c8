"""Storage tiers of a shard: memory (LRU, byte capacity) spilling to disk (survives restarts).

Every tier is a `Tier`; the shard's placement (`prefix_store.shard.placement`) decides
what goes where and what an eviction spills.
"""

from prefix_store.tiers.base import Tier
from prefix_store.tiers.disk import DiskTier
from prefix_store.tiers.memory import MemoryTier

__all__ = ["DiskTier", "MemoryTier", "Tier"]
