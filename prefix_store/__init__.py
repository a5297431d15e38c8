"""The prefix store: keys, storage tiers, shards, metadata plane and client SDK (to come)."""
