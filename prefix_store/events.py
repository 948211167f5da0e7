"""KV cache events: what an engine's KV manager announces and the prefix index applies.

Every event carries a sequence number that grows by one per event, so a consumer that sees a
gap knows it missed something and asks for a snapshot. Hashes are the engine-independent
chained block hashes of `hashing.py`; the index reads only them and the sequence numbers,
never the tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from prefix_store.hashing import BlockHash


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    """Consecutive full blocks of one sequence entered the prefix cache."""

    seq: int
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # parent of block_hashes[0]; None at a sequence start
    token_ids: list[int]  # the tokens of all the blocks, concatenated (none for the tier's)
    block_size: int
    tier: bool = False  # the blocks entered the engine's KV tier, not its pool: reloadable, not mapped


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    """Blocks left the prefix cache: evicted to make room, or a failed step never wrote their KV."""

    seq: int
    block_hashes: list[BlockHash]
    tier: bool = False  # they left the engine's KV tier


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    """The whole prefix cache was dropped (`reset_prefix_cache`), its tier's blocks too."""

    seq: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

# The index keeps an engine's tier blocks beside its pool's, under the hash with this prefix (a
# hash alone is 32 bytes, so the two never meet); a snapshot lists both kinds of keys.
TIER_TAG = b"T"


def index_keys(event: BlockStored | BlockRemoved) -> list[bytes]:
    """The index keys an event's blocks go under: their hashes, tagged when they are the tier's."""
    return [TIER_TAG + h for h in event.block_hashes] if event.tier else list(event.block_hashes)


class ApplyResult(enum.Enum):
    """What a store did with a batch: applied it, or found it cannot follow the stream."""

    APPLIED = "applied"
    # The store's last sequence number for the engine is unknown (new, cleared or expired
    # engine) or the batch does not continue it: the engine must publish a snapshot.
    NEED_SNAPSHOT = "need_snapshot"


def events_to_apply(last_seq: int | None, events: Sequence[KVEvent]) -> list[KVEvent] | None:
    """The part of a batch that follows `last_seq`, or None when the stream has a gap.

    Events at or below `last_seq` were applied already (a batch resent after a lost reply)
    and are skipped; the rest must continue the sequence one by one.
    """
    if last_seq is None:
        return None
    fresh = [e for e in events if e.seq > last_seq]
    expected = last_seq + 1
    for event in fresh:
        if event.seq != expected:
            return None
        expected += 1
    return fresh
