"""KV cache events: what the cluster prefix index learns about the blocks an engine holds.

Every event carries a sequence number that grows by one per event, so a consumer that sees a gap
knows it missed something and asks for a snapshot. Hashes are the engine-independent chained
block hashes of `block_hash.py`.
"""

from __future__ import annotations

from collections import deque

import msgspec

from actors.kv.block_hash import BlockHash


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    """Consecutive full blocks of one sequence entered the prefix cache."""

    seq: int
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # parent of block_hashes[0]; None at a sequence start
    token_ids: list[int]  # the tokens of all the blocks, concatenated
    block_size: int


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    """Blocks left the prefix cache: evicted to make room, or a failed step never wrote their KV."""

    seq: int
    block_hashes: list[BlockHash]


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    """The whole prefix cache was dropped (`reset_prefix_cache`)."""

    seq: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventLog:
    """Numbers events and keeps them until drained.

    Bounded: when nobody drains, the oldest events are dropped, and the consumer sees the gap in
    the sequence numbers and asks for a snapshot instead (memory never grows without bound).
    """

    def __init__(self, max_events: int = 100_000) -> None:
        self._next_seq = 0
        self._events: deque[KVEvent] = deque(maxlen=max_events)

    def stored(self, hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int], block_size: int) -> None:
        self._events.append(BlockStored(self._take_seq(), hashes, parent, token_ids, block_size))

    def removed(self, hashes: list[BlockHash]) -> None:
        self._events.append(BlockRemoved(self._take_seq(), hashes))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared(self._take_seq()))

    def take(self) -> list[KVEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq
