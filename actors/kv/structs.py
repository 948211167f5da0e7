"""The small values the KV cache manager takes and returns: its config, a sequence, a prefix hit.

Plain data only; the manager (`manager.py`) holds the behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from prefix_store.hashing import BlockHash


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    record_events: bool = True  # keep stored/removed/cleared events for `take_events()`
    max_events: int = 100_000  # undrained events beyond this are dropped (consumers see the gap)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.max_events < 1:
            raise ValueError(f"max_events must be at least 1, got {self.max_events}")


class KVRequest(msgspec.Struct, frozen=True):
    """A sequence as the KV manager first sees it."""

    seq_id: str
    token_ids: list[int]  # the prompt, plus the output so far when a preempted request resumes
    cache_salt: str | None = None  # per tenant: different salts never share cached blocks
    read_cache: bool = True  # False: no hit, every position computed (its blocks are still cached)


class PrefixHit(msgspec.Struct, frozen=True):
    """Result of `get_computed_blocks`: cached leading blocks a new sequence can map.

    Hand it back to `can_allocate` / `allocate_slots` in the same scheduling pass; once other
    allocations have evicted one of its blocks, those calls raise `StalePrefixHit`.
    """

    request: KVRequest
    block_ids: list[int]
    block_hashes: list[BlockHash]  # every full block of request.token_ids, reused at allocation
    num_computed_tokens: int  # (len(block_ids) + len(loaded)) * block_size: prefill starts here
    loaded: list[bytes] = []  # the tier's blocks that continue block_ids, copied in at allocation
    loaded_from_disk: int = 0  # of those, the ones read from disk


class PrefixCacheStats(msgspec.Struct, frozen=True):
    """Cumulative counters, counted when a looked-up sequence is admitted (not on every look-up)."""

    requests: int
    queried_tokens: int
    hit_tokens: int  # from the pool and the tier
    tier_hit_tokens: int = 0  # of those, copied back from the tier


class StalePrefixHit(ValueError):
    """A PrefixHit whose blocks were evicted since it was computed; look up again."""
