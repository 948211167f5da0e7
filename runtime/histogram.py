"""A histogram of observations, for whoever counts latencies: the router, the scheduler."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


class Histogram:
    """Prometheus-style histogram: bounds, counts per bucket, sum, count. Plain numbers, no registry."""

    def __init__(self, buckets: Sequence[float]):
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
