"""Exact KV is stored and looked up under the exact-attention kernel that computed it.

The fused kernel's KV is not bitwise the torch kernel's, so a decoder running the other
kernel must find nothing (a miss, then a recompute), never KV it cannot verify against.
"""

from __future__ import annotations

import pytest

from decoder.config import ModelConfig
from decoder.store_source import kv_layout
from numerics.cpu import fused as fused_ext
from numerics.cpu.forward import TORCH_KERNEL_ID, exact_kernel_id
from prefix_store.keys import chunk_keys
from tests.prefix_store.conftest import Store, random_kv

CONFIG = ModelConfig(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_kv_heads=2,
    num_heads=4,
    head_dim=16,
)
FINGERPRINT = "0123456789abcdef0123456789abcdef"

pytestmark = pytest.mark.fused_kernel  # skips only where the CPU cannot run it


def torch_kernel_layout(monkeypatch):
    """kv_layout as a process configured with VERICACHE_EXACT_KERNEL=torch derives it."""
    with monkeypatch.context() as m:
        m.setenv(fused_ext.ENV, "torch")
        m.setattr(fused_ext, "_loaded", {})
        assert exact_kernel_id(CONFIG.head_dim) == TORCH_KERNEL_ID
        return kv_layout(CONFIG, FINGERPRINT)


def test_layout_identity_carries_the_kernel(monkeypatch):
    fused = kv_layout(CONFIG, FINGERPRINT)
    assert fused.model_id == f"{FINGERPRINT}+{exact_kernel_id(CONFIG.head_dim)}"
    other = torch_kernel_layout(monkeypatch)
    assert other.model_id == f"{FINGERPRINT}+{TORCH_KERNEL_ID}"
    tokens = list(range(600))
    a, b = chunk_keys(tokens, fused, b"salt"), chunk_keys(tokens, other, b"salt")
    assert len(a) == len(b) == 3 and not set(a) & set(b)


@pytest.fixture
def shard(redis_server, metadata, tmp_path):
    store = Store(redis_server.url, tmp_path)
    store.start("shard-0")
    yield store
    store.close()


def test_kv_of_another_kernel_is_a_miss(monkeypatch, shard, metadata):
    tokens = list(range(100, 700))
    fused = kv_layout(CONFIG, FINGERPRINT)
    token = metadata.add_tenant("decoder")
    with shard.client(token) as client:
        client.publish_prefix(tokens, random_kv(fused, len(tokens)), fused)
        assert client.lookup(tokens, fused).tokens == len(tokens)
        assert client.lookup(tokens, torch_kernel_layout(monkeypatch)).tokens == 0
