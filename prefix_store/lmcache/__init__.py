"""A gateway speaking LMCache's remote server protocol (`lm://`) over the prefix store,
and the mapping between LMCache's chunk keys and KV layout and the store's."""

from prefix_store.lmcache.config import GatewayConfig
from prefix_store.lmcache.errors import GatewayError, ProtocolError
from prefix_store.lmcache.gateway import LMCacheGateway
from prefix_store.lmcache.objects import ObjectStore

__all__ = ["GatewayConfig", "GatewayError", "LMCacheGateway", "ObjectStore", "ProtocolError"]
