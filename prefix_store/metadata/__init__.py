"""The metadata plane in Redis: shard membership, tenants, shared namespaces, usage.

Only small, soft state lives here; no KV bytes ever do. Shards re-write their membership
and usage on every heartbeat, so a restarted Redis is repopulated within one heartbeat.
Tenants and namespaces are durable only as far as Redis persists them (the embedded
Redis runs with an append-only file).

Keys (prefix "vc:"):
  vc:shard:<id>            JSON {address, ...stats}, expires after the shard's TTL
  vc:usage:<id>            hash tenant -> bytes stored on that shard, same TTL
  vc:tenant:<name>         hash {quota, salt, created, token (the token's sha256),
                           weight (its fair share's weight, default 1.0), admin (0|1)}
  vc:tenants               set of tenant names
  vc:token:<sha256>        tenant name
  vc:ns:<name>             hash {salt, owner} of a shared namespace
  vc:ns:<name>:members     set of tenant names (every role)
  vc:ns:<name>:readers     the members that may only read
  vc:config                hash {replication}
"""

from __future__ import annotations

from prefix_store.metadata.membership import Membership
from prefix_store.metadata.namespaces import SharedNamespaces
from prefix_store.metadata.tenants import Tenants


class Metadata(Membership, Tenants, SharedNamespaces):
    """The metadata plane's client over one Redis connection (`RedisPlane`), its commands
    by noun in their own modules (as redis-py composes its command mixins): shard
    membership and usage (`membership`), tenants and tokens (`tenants`), shared
    namespaces (`namespaces`). Thread-safe as redis-py's client is."""
