"""KV-aware routing policy: weigh the prefix blocks an engine already holds against its load.

Pure and synchronous. The cost of sending a prompt to an engine is counted in blocks of
prefill work: the blocks it would have to compute, a fraction of a block for each it would copy
back from its KV tier, plus what its queue and KV usage are worth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

PREFIX, LOAD, FALLBACK = "prefix", "load", "fallback"


class EngineLoad(msgspec.Struct, frozen=True):
    """An engine's load as its last `EngineStats` reported it."""

    engine_id: str
    requests_running: int = 0
    requests_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0

    @property
    def kv_usage(self) -> float:
        if self.kv_blocks_total <= 0:
            return 0.0
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total


class RouteDecision(msgspec.Struct, frozen=True):
    engine_id: str
    reason: str  # PREFIX, LOAD or FALLBACK
    matched_blocks: int  # leading prompt blocks the chosen engine holds in its pool (0 on fallback)
    tier_blocks: int = 0  # the blocks after those that it holds in its KV tier
    pull_from: str | None = None  # another engine that holds more of the prompt's prefix, to pull from


@dataclass(frozen=True)
class RoutingConfig:
    # One running request costs as much as prefilling this many blocks (it shares each step).
    running_cost_blocks: float = 1.0
    # A waiting request delays ours by its whole prefill, so it weighs more.
    waiting_cost_blocks: float = 4.0
    # What a full KV cache costs: a nearly full engine evicts and preempts.
    kv_usage_cost_blocks: float = 16.0
    # Copying a block back from an engine's KV tier instead of computing it (memory or disk reads).
    tier_block_cost_blocks: float = 0.125
    # Another engine holding at least this many more leading blocks than the chosen one (in its pool or
    # tier) is named for the chosen one to pull them from (actors/kv/prefix_pull.py) instead of computing.
    min_pull_blocks: int = 4
    # At or past either limit an engine is overloaded and only chosen if all are.
    max_waiting: int = 64
    max_kv_usage: float = 0.98

    def __post_init__(self) -> None:
        for name in ("running_cost_blocks", "waiting_cost_blocks", "kv_usage_cost_blocks", "tier_block_cost_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.min_pull_blocks < 1:
            raise ValueError(f"min_pull_blocks must be >= 1, got {self.min_pull_blocks}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"max_kv_usage must be in (0, 1], got {self.max_kv_usage}")


class RoutingPolicy:
    def __init__(self, config: RoutingConfig | None = None):
        self.config = config or RoutingConfig()
        self._turn = 0  # rotates ties, so equally good engines share the work

    def load_cost(self, load: EngineLoad) -> float:
        c = self.config
        return (c.running_cost_blocks * load.requests_running
                + c.waiting_cost_blocks * load.requests_waiting
                + c.kv_usage_cost_blocks * load.kv_usage)

    def overloaded(self, load: EngineLoad) -> bool:
        return (load.requests_waiting >= self.config.max_waiting
                or load.kv_usage >= self.config.max_kv_usage)

    def choose(self, loads: Sequence[EngineLoad], matched: Mapping[str, int | tuple[int, int]] | None,
               num_blocks: int) -> RouteDecision:
        """Pick an engine for a prompt of `num_blocks` full blocks.

        `matched` is the index's answer ({engine: leading blocks held}, or {engine: (in its pool, in
        its pool or KV tier)}); None means the index could not answer, and the least-loaded engine wins.
        """
        if not loads:
            raise ValueError("no engine to route to")
        pool = [l for l in loads if not self.overloaded(l)] or list(loads)
        if matched is None:
            costs = [self.load_cost(l) for l in pool]
        else:
            costs = []
            for l in pool:
                held, reach = _held(matched, l.engine_id, num_blocks)
                costs.append(num_blocks - reach + self.config.tier_block_cost_blocks * (reach - held)
                             + self.load_cost(l))
        best = min(costs)
        ties = [l for l, c in zip(pool, costs) if c <= best + 1e-9]
        chosen = ties[self._turn % len(ties)]
        self._turn += 1
        if matched is None:
            return RouteDecision(chosen.engine_id, FALLBACK, 0)
        held, reach = _held(matched, chosen.engine_id, num_blocks)
        return RouteDecision(chosen.engine_id, PREFIX if reach > 0 else LOAD, held, reach - held,
                             self.pull_source(loads, matched, num_blocks, chosen.engine_id))

    def pull_source(self, loads: Sequence[EngineLoad], matched: Mapping[str, int | tuple[int, int]] | None,
                    num_blocks: int, chosen: str) -> str | None:
        """The engine holding the most of the prompt beyond what `chosen` holds (however it was chosen),
        when that is enough to pull; loaded or not (giving blocks costs it no forward)."""
        if matched is None:
            return None
        best, best_reach = None, _held(matched, chosen, num_blocks)[1] + self.config.min_pull_blocks - 1
        for load in loads:
            other = _held(matched, load.engine_id, num_blocks)[1]
            if load.engine_id != chosen and other > best_reach:
                best, best_reach = load.engine_id, other
        return best


def _held(matched: Mapping[str, int | tuple[int, int]], engine_id: str, num_blocks: int) -> tuple[int, int]:
    """(leading blocks in the engine's pool, in its pool or tier), at most `num_blocks` each."""
    counts = matched.get(engine_id, 0)
    held, reach = (counts, counts) if isinstance(counts, int) else counts
    return min(held, num_blocks), min(reach, num_blocks)
