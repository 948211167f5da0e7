"""How the index reads the KV manager's events: sequence checks and the outcome of a batch.

The events themselves are the KV manager's own (`actors.kv.events`); the index only needs
their sequence numbers and block hashes, never the tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from actors.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["AllBlocksCleared", "ApplyResult", "BlockRemoved", "BlockStored", "KVEvent", "events_to_apply"]


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
