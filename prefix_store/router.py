"""The gateway's router: one bounded index lookup, then the policy; never fails a request.

A lookup that errors or outlives `timeout_s` falls back to least-loaded routing, and the
index is then skipped for `cooldown_s`, so a dead Redis costs one timeout, not one per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import structlog

from prefix_store.metrics import RoutingMetrics
from prefix_store.policy import EngineLoad, RouteDecision, RoutingPolicy
from prefix_store.store import PrefixStore

log = structlog.get_logger(__name__)


class PrefixRouter:
    def __init__(
        self,
        store: PrefixStore | None,
        policy: RoutingPolicy | None = None,
        *,
        timeout_s: float = 0.05,
        cooldown_s: float = 1.0,
        metrics: RoutingMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s}")
        self.store = store
        self.policy = policy or RoutingPolicy()
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self.metrics = metrics or RoutingMetrics()
        self._clock = clock
        self._skip_until = float("-inf")

    async def lookup(self, block_hashes: Sequence[bytes]) -> dict[str, tuple[int, int]] | None:
        """The index's answer ({engine: (leading blocks in its pool, in its pool or KV tier)}), or
        None when it is absent, failing, slow or cooling down."""
        if self.store is None or self._clock() < self._skip_until:
            return None
        if not block_hashes:
            return {}  # a prompt shorter than a block: nothing to match, route by load
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.store.match_tiers(block_hashes)
        except Exception as exc:  # any index failure only costs speed, never the request
            self.metrics.lookup_errors += 1
            if self._clock() >= self._skip_until:  # one line per outage, not per request
                log.warning("prefix index lookup failed; routing by load",
                            error=repr(exc), cooldown_s=self.cooldown_s)
            self._skip_until = self._clock() + self.cooldown_s
            return None
        finally:
            self.metrics.lookup_seconds.observe(time.perf_counter() - start)

    async def route(self, block_hashes: Sequence[bytes],
                    loads: Callable[[], Sequence[EngineLoad]]) -> RouteDecision:
        """Pick one of the engines `loads()` gives (ValueError when there is none) for a prompt's hashes. The
        loads are read once the index has answered: prompts routed meanwhile (their lookups overlapping this
        one) have been counted on their engines by then, where loads read before the lookup would have
        sent a burst of them all to the engine that was least loaded when it started."""
        matched = await self.lookup(block_hashes)
        decision = self.policy.choose(loads(), matched, len(block_hashes))
        self.metrics.record_decision(decision.reason, decision.matched_blocks, len(block_hashes))
        return decision
