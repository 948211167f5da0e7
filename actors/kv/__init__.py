"""KV block manager: paged blocks, prefix caching on chained block hashes, refcounts, LRU eviction.

The hashes and the cache events it announces are `prefix_store`'s (`hashing`, `events`): the
cluster index shares them without importing the engine.
"""

from actors.kv.manager import KVCacheManager
from actors.kv.structs import KVCacheConfig, KVRequest, PrefixCacheStats, PrefixHit, StalePrefixHit

__all__ = ["KVCacheConfig", "KVCacheManager", "KVRequest", "PrefixCacheStats", "PrefixHit", "StalePrefixHit"]
