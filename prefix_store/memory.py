"""In-memory prefix index: the embedded default, and the twin the Redis index must agree with.

Coroutines that never await, so each call is atomic on the event loop; the clock is
injectable so liveness can be tested without sleeping.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prefix_store.events import TIER_TAG, AllBlocksCleared, ApplyResult, BlockStored, KVEvent, events_to_apply, index_keys
from prefix_store.store import PrefixStore, validate_ttl


@dataclass
class _Engine:
    last_seq: int
    expires_at: float
    # Refcount per hash: two physical blocks may hold the same content.
    blocks: Counter[bytes] = field(default_factory=Counter)


class InMemoryPrefixStore(PrefixStore):
    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = validate_ttl(ttl_s)
        self._clock = clock
        self._engines: dict[str, _Engine] = {}

    def _live(self, engine_id: str) -> _Engine | None:
        engine = self._engines.get(engine_id)
        if engine is not None and engine.expires_at <= self._clock():
            del self._engines[engine_id]  # lapsed: forget it, as Redis expiry would
            return None
        return engine

    async def apply_events(self, engine_id: str, events: Sequence[KVEvent]) -> ApplyResult:
        engine = self._live(engine_id)
        todo = events_to_apply(engine.last_seq if engine else None, list(events))
        if engine is None or todo is None:
            return ApplyResult.NEED_SNAPSHOT
        blocks = engine.blocks
        for event in todo:
            if isinstance(event, BlockStored):
                blocks.update(index_keys(event))
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()
            else:
                for key in index_keys(event):
                    if blocks[key] <= 1:
                        del blocks[key]
                    else:
                        blocks[key] -= 1
            engine.last_seq = event.seq
        engine.expires_at = self._clock() + self.ttl_s
        return ApplyResult.APPLIED

    async def publish_snapshot(
        self, engine_id: str, block_hashes: Iterable[bytes], next_seq: int
    ) -> None:
        blocks = Counter(block_hashes)
        self._engines[engine_id] = _Engine(next_seq - 1, self._clock() + self.ttl_s, blocks)

    async def clear_engine(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)

    async def heartbeat(self, engine_id: str) -> bool:
        engine = self._live(engine_id)
        if engine is None:
            return False
        engine.expires_at = self._clock() + self.ttl_s
        return True

    async def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        return {engine_id: pool for engine_id, (pool, _) in (await self.match_tiers(block_hashes)).items()}

    async def match_tiers(self, block_hashes: Sequence[bytes]) -> dict[str, tuple[int, int]]:
        result = {}
        for engine_id in await self.live_engines():
            blocks = self._engines[engine_id].blocks
            pool = 0
            while pool < len(block_hashes) and block_hashes[pool] in blocks:
                pool += 1
            reach = pool
            while reach < len(block_hashes) and (block_hashes[reach] in blocks
                                                 or TIER_TAG + block_hashes[reach] in blocks):
                reach += 1
            result[engine_id] = (pool, reach)
        return result

    async def live_engines(self) -> list[str]:
        return sorted(e for e in list(self._engines) if self._live(e) is not None)
