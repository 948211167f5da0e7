"""The cluster-wide prefix index and KV-aware routing, and the block identity both sides share.

Block hashing (`hashing`) and the KV cache events (`events`) live here, below the engine: the KV
manager announces the events and hashes blocks with them, gateways hash prompts the same way
(`PromptHasher`), engines publish their events (`IndexPublisher`) and gateways route on the
index's answer (`PrefixRouter`). Nothing here imports the engine.
"""

from prefix_store.events import AllBlocksCleared, ApplyResult, BlockRemoved, BlockStored, KVEvent
from prefix_store.hashing import BlockHash, PromptHasher, TenantSalts, adapter_salt, hash_block, hash_full_blocks
from prefix_store.memory import InMemoryPrefixStore
from prefix_store.metrics import Histogram, RoutingMetrics
from prefix_store.policy import EngineLoad, RouteDecision, RoutingConfig, RoutingPolicy
from prefix_store.publisher import IndexPublisher, KVEventSource
from prefix_store.redis_store import RedisPrefixStore, make_client
from prefix_store.router import PrefixRouter
from prefix_store.store import PrefixStore

__all__ = [
    "AllBlocksCleared", "ApplyResult", "BlockHash", "BlockRemoved", "BlockStored", "EngineLoad",
    "Histogram", "InMemoryPrefixStore", "IndexPublisher", "KVEvent", "KVEventSource", "PrefixRouter",
    "PrefixStore", "PromptHasher", "RedisPrefixStore", "RouteDecision", "RoutingConfig",
    "RoutingMetrics", "RoutingPolicy", "TenantSalts", "adapter_salt", "hash_block", "hash_full_blocks", "make_client",
]
