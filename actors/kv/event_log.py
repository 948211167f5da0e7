"""The KV manager's event log: numbers the cache events of `prefix_store.events` as they happen.

The event types belong to the prefix index's package, so the index never imports the engine;
here they only get their sequence numbers, one more per event, and wait to be drained.
"""

from __future__ import annotations

from collections import deque

from prefix_store.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefix_store.hashing import BlockHash


class EventLog:
    """Numbers events and keeps them until drained.

    Bounded: when nobody drains, the oldest events are dropped, and the consumer sees the gap in
    the sequence numbers and asks for a snapshot instead (memory never grows without bound).
    """

    def __init__(self, max_events: int = 100_000) -> None:
        self._next_seq = 0
        self._events: deque[KVEvent] = deque(maxlen=max_events)

    def stored(self, hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int], block_size: int,
               tier: bool = False) -> None:
        self._events.append(BlockStored(self._take_seq(), hashes, parent, token_ids, block_size, tier))

    def removed(self, hashes: list[BlockHash], tier: bool = False) -> None:
        self._events.append(BlockRemoved(self._take_seq(), hashes, tier))

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
