"""The prefix store: the full prefix KV on remote shards.

Public surface: `prefix_store.client` (`StoreClient`, `AsyncStoreClient`, `CachedPrefix`),
`prefix_store.layout.KVLayout`, `prefix_store.errors` (typed errors; `status` maps them to
gRPC codes), and for running shards `prefix_store.server.ShardServer` with
`prefix_store.config.ShardConfig`. Inside: `keys` (chunk keys), `tiers/` (memory, disk),
`shard` (lookup, two-phase put, leased fetch), `metadata` (Redis), `auth`, `data_plane`.
"""
