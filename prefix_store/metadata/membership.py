"""Shard membership and usage: each shard's record and per-tenant bytes, re-written on every
heartbeat and expiring after its TTL; the replication factor."""

from __future__ import annotations

import json

from prefix_store.metadata.records import RedisPlane, ShardRecord


class Membership(RedisPlane):
    def heartbeat(self, shard_id: str, address: str, info: dict, usage: dict, ttl_s: float):
        def write():
            pipe = self.redis.pipeline()
            ttl_ms = int(ttl_s * 1000)
            record = json.dumps({"address": address, **info})
            pipe.set(f"{self.p}:shard:{shard_id}", record, px=ttl_ms)
            pipe.delete(f"{self.p}:usage:{shard_id}")
            if usage:
                pipe.hset(f"{self.p}:usage:{shard_id}", mapping=usage)
                pipe.pexpire(f"{self.p}:usage:{shard_id}", ttl_ms)
            pipe.execute()

        self._call(write)

    def deregister(self, shard_id: str) -> None:
        self._call(self.redis.delete, f"{self.p}:shard:{shard_id}", f"{self.p}:usage:{shard_id}")

    def shards(self) -> list[ShardRecord]:
        def read():
            keys = sorted(self.redis.scan_iter(match=f"{self.p}:shard:*", count=1000))
            values = self.redis.mget(keys) if keys else []
            out = []
            for key, value in zip(keys, values, strict=True):
                if value is None:
                    continue
                info = json.loads(value)
                shard_id = key.decode().split(":", 2)[2]
                out.append(ShardRecord(shard_id, info.pop("address"), info))
            return out

        return self._call(read)

    def usage(self, exclude_shard: str | None = None) -> dict[str, int]:
        """Bytes per tenant over the live shards (optionally leaving one out)."""

        def read():
            total: dict[str, int] = {}
            for shard in self.shards():
                if shard.shard_id == exclude_shard:
                    continue
                for tenant, value in self.redis.hgetall(f"{self.p}:usage:{shard.shard_id}").items():
                    total[tenant.decode()] = total.get(tenant.decode(), 0) + int(value)
            return total

        return self._call(read)

    def replication(self) -> int:
        value = self._call(self.redis.hget, f"{self.p}:config", "replication")
        return int(value) if value else 0

    def set_replication(self, factor: int) -> None:
        self._call(self.redis.hset, f"{self.p}:config", "replication", int(factor))
