"""Store fixtures: real shards serving gRPC on loopback, over the session's real Redis."""

from __future__ import annotations

import pytest
import torch

from prefix_store.config import ClientConfig, ShardConfig
from prefix_store.layout import KVLayout

LAYOUT = KVLayout(
    "test-model@1", "float32", num_layers=4, num_kv_heads=2, head_dim=8, chunk_tokens=16
)


def random_kv(layout: KVLayout, tokens: int, seed: int = 0) -> torch.Tensor:
    """[layers, 2, kv_heads, tokens, head_dim] of the layout's dtype."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, layout.num_kv_heads, tokens, layout.head_dim)
    return torch.randn(shape, generator=g).to(layout.torch_dtype)


class Store:
    """Shards on loopback (each a real gRPC server), started and stopped by tests."""

    def __init__(self, redis_url: str, tmp_path) -> None:
        self.redis_url = redis_url
        self.tmp_path = tmp_path
        self.servers = {}

    def start(self, shard_id: str = "shard-0", **overrides):
        from prefix_store.server import ShardServer

        overrides.setdefault("disk_dir", self.tmp_path / shard_id)
        overrides.setdefault("heartbeat_s", 0.2)
        overrides.setdefault("ttl_s", 1.0)
        config = ShardConfig(shard_id=shard_id, **overrides)
        server = ShardServer(config, self.redis_url)
        server.start()
        self.servers[shard_id] = server
        return server

    def stop(self, shard_id: str, grace_s: float = 0.5) -> None:
        self.servers.pop(shard_id).stop(grace_s)

    @property
    def endpoints(self) -> list[str]:
        return [s.address for s in self.servers.values()]

    def client(self, token: str, **config):
        from prefix_store.client import StoreClient

        config.setdefault("timeout_s", 10.0)
        config.setdefault("stream_timeout_s", 30.0)
        config.setdefault("retries", 2)
        return StoreClient(self.endpoints, token, ClientConfig(**config))

    def close(self) -> None:
        for shard_id in list(self.servers):
            self.stop(shard_id, grace_s=0)


@pytest.fixture
def store(metadata, redis_server, tmp_path):
    store = Store(redis_server.url, tmp_path)
    yield store
    store.close()
