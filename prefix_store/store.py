"""The prefix index interface: which engine holds which KV block hashes.

Engines publish their KV cache events; gateways ask, for a prompt's block hashes, how many
leading blocks each live engine holds. The index only ever costs speed when it is wrong: an
engine checks block identity itself, so no answer here can change generated tokens.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

from prefix_store.events import ApplyResult, KVEvent


class PrefixStore(abc.ABC):
    """One index shared by every gateway; two implementations (in-memory, Redis) agree exactly.

    Liveness: an engine is live while it refreshes within `ttl_s` (heartbeat, events or a
    snapshot); past that its entries are ignored and expire, and its next batch of events
    gets NEED_SNAPSHOT.
    """

    ttl_s: float

    @abc.abstractmethod
    async def apply_events(self, engine_id: str, events: Sequence[KVEvent]) -> ApplyResult:
        """Apply one step's events atomically, or apply none and return NEED_SNAPSHOT."""

    @abc.abstractmethod
    async def publish_snapshot(
        self, engine_id: str, block_hashes: Iterable[bytes], next_seq: int
    ) -> None:
        """Replace the engine's entries with `block_hashes`; its next event is `next_seq`.

        The pair is what `KVCacheManager.snapshot()` returns. Events below `next_seq` are
        already reflected and are skipped if they arrive later. A hash listed twice counts
        twice (two blocks with the same content, each announced and removed on its own).
        """

    @abc.abstractmethod
    async def clear_engine(self, engine_id: str) -> None:
        """Forget the engine: its entries, its sequence number and its liveness."""

    @abc.abstractmethod
    async def heartbeat(self, engine_id: str) -> bool:
        """Keep a known engine live for another `ttl_s`; False if it was unknown or had expired."""

    @abc.abstractmethod
    async def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """{engine_id: leading blocks of `block_hashes` it holds} for every live engine."""

    @abc.abstractmethod
    async def match_tiers(self, block_hashes: Sequence[bytes]) -> dict[str, tuple[int, int]]:
        """{engine_id: (leading blocks in its pool, leading blocks in its pool or its KV tier)}: the
        second count is what it can serve without computing, some blocks by copying them back."""

    @abc.abstractmethod
    async def live_engines(self) -> list[str]:
        """The engines whose liveness has not lapsed, sorted."""

    async def close(self) -> None:
        """Release connections; the in-memory store has none."""


def validate_ttl(ttl_s: float) -> float:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    return float(ttl_s)
