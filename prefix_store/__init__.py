"""The cluster-wide prefix index and KV-aware routing.

Engines publish their KV manager's block events (`IndexPublisher`); gateways hash prompts the
way the engine will (`PromptHasher`) and route on the index's answer (`PrefixRouter`).
"""

from prefix_store.events import ApplyResult
from prefix_store.hashing import PromptHasher, TenantSalts
from prefix_store.memory import InMemoryPrefixStore
from prefix_store.metrics import Histogram, RoutingMetrics
from prefix_store.policy import EngineLoad, RouteDecision, RoutingConfig, RoutingPolicy
from prefix_store.publisher import IndexPublisher, KVEventSource
from prefix_store.redis_store import RedisPrefixStore, make_client
from prefix_store.router import PrefixRouter
from prefix_store.store import PrefixStore

__all__ = [
    "ApplyResult", "EngineLoad", "Histogram", "InMemoryPrefixStore", "IndexPublisher",
    "KVEventSource", "PrefixRouter", "PrefixStore", "PromptHasher", "RedisPrefixStore",
    "RouteDecision", "RoutingConfig", "RoutingMetrics", "RoutingPolicy", "TenantSalts",
    "make_client",
]
