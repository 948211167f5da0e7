"""Plain counters and a histogram for routing, for the gateway to expose however it likes.

No metrics library and no global registry: one `RoutingMetrics` per router, read directly.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence

# Seconds; index lookups should sit in the first few buckets.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Prometheus-style histogram (the same fields as the gateway's): bounds, counts, sum, count."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS):
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("histogram buckets must be non-empty, distinct and increasing")
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) pairs, ending with (inf, count)."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out


class RoutingMetrics:
    def __init__(self) -> None:
        # Why each request went where it went: "prefix", "load" or "fallback".
        self.decisions: Counter[str] = Counter()
        self.lookup_seconds = Histogram()
        self.lookup_errors = 0  # failed or timed-out index lookups
        # Of the prompt blocks routed, how many the chosen engine was expected to hold.
        self.blocks_requested = 0
        self.blocks_matched = 0

    def record_decision(self, reason: str, matched: int, requested: int) -> None:
        self.decisions[reason] += 1
        self.blocks_requested += requested
        self.blocks_matched += matched
