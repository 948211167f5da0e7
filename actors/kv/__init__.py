"""KV block manager: paged blocks, chained prefix hashes, refcounts, LRU eviction and cache events."""

from actors.kv.block_hash import BlockHash, hash_block, hash_full_blocks
from actors.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from actors.kv.manager import KVCacheManager
from actors.kv.structs import KVCacheConfig, KVRequest, PrefixCacheStats, PrefixHit, StalePrefixHit

__all__ = [
    "AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "KVCacheConfig", "KVCacheManager",
    "KVEvent", "KVRequest", "PrefixCacheStats", "PrefixHit", "StalePrefixHit", "hash_block", "hash_full_blocks",
]
