"""The store's methods about the caller itself: Describe (its tenant, namespaces, the
shards and their kernels) and Stats (capacities and its own data, nothing of others')."""

from __future__ import annotations

from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.server.service import Service
from rpc.handler import unary


class Admin:
    """Describe and Stats."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.gate = service.gate

    @unary
    def Describe(self, request, call):
        tenant, _ = self.service.caller(call)
        shards = self.service.metadata.shards()
        replication = self.service.metadata.replication() or min(2, max(1, len(shards)))
        return pb.DescribeResponse(
            tenant=tenant.name,
            namespaces=[
                pb.NamespaceInfo(name=n.name, salt=n.salt) for n in tenant.namespaces.values()
            ],
            shards=[
                pb.ShardInfo(
                    shard_id=s.shard_id,
                    address=s.address,
                    data_address=s.info.get("data_address", ""),
                    attention_kernel=s.info.get("attention_kernel", ""),
                )
                for s in shards
            ],
            replication=min(replication, max(1, len(shards))),
            max_message_bytes=self.service.config.max_message_bytes,
            weight=tenant.weight,
            admin=tenant.admin,
        )

    @unary
    def Stats(self, request, call):
        tenant, _ = self.service.caller(call)
        return pb.StatsResponse(**self.tenant_stats(tenant.name))

    def tenant_stats(self, tenant: str) -> dict:
        """What a tenant may see: capacities and its own data. Shard-wide activity (other
        tenants' bytes, hits, fetches) stays with operators (`vericache status`)."""
        counts = self.service.shard.counts(owner=tenant)
        return {
            "shard_id": self.service.config.shard_id,
            "memory_capacity": self.service.shard.memory.capacity,
            "disk_capacity": self.service.shard.disk.capacity,
            "chunks": counts["chunks"],
            "artifacts": counts["artifacts"],
            "tenant_bytes": self.service.shard.usage().get(tenant, 0),
        }
