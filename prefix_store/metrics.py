"""Plain counters and a histogram for routing, for the gateway to expose however it likes.

No metrics library and no global registry: one `RoutingMetrics` per router, read directly.
"""

from __future__ import annotations

from collections import Counter

from runtime.histogram import Histogram

# Seconds; index lookups should sit in the first few buckets.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RoutingMetrics:
    def __init__(self) -> None:
        # Why each request went where it went: "prefix", "load" or "fallback".
        self.decisions: Counter[str] = Counter()
        self.lookup_seconds = Histogram(LATENCY_BUCKETS)
        self.lookup_errors = 0  # failed or timed-out index lookups
        # Of the prompt blocks routed, how many the chosen engine was expected to hold.
        self.blocks_requested = 0
        self.blocks_matched = 0

    def record_decision(self, reason: str, matched: int, requested: int) -> None:
        self.decisions[reason] += 1
        self.blocks_requested += requested
        self.blocks_matched += matched
