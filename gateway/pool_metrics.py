"""The cluster's own metrics as a prometheus_client collector: routing decisions by reason,
prefix-index lookup latency, request migrations and live engines. Registered with the gateway's
registry once the pool is up; the engines' own metrics are on each engine's /metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from prefix_store import RoutingMetrics


class PoolMetrics(Collector):
    def __init__(self, routing: RoutingMetrics, engines: Callable[[], int] = lambda: 0):
        self.routing = routing
        self.migrations = 0
        self._engines = engines

    def collect(self) -> Iterator:
        r = self.routing
        decisions = CounterMetricFamily("matinee_routing_decisions", "Requests routed, by why the engine was chosen.",
                                        labels=["reason"])
        for reason, n in sorted(r.decisions.items()):
            decisions.add_metric([reason], n)
        yield decisions
        yield CounterMetricFamily("matinee_prefix_index_lookup_errors", "Failed or timed-out index lookups.",
                                  value=r.lookup_errors)
        blocks = CounterMetricFamily("matinee_routed_prefix_blocks", "Prompt blocks routed, and those the "
                                     "chosen engine was expected to hold.", labels=["kind"])
        blocks.add_metric(["requested"], r.blocks_requested)
        blocks.add_metric(["matched"], r.blocks_matched)
        yield blocks
        lookups = HistogramMetricFamily("matinee_prefix_index_lookup_seconds", "Prefix index lookup latency.")
        h = r.lookup_seconds
        lookups.add_metric([], [("+Inf" if b == float("inf") else repr(b), n) for b, n in h.cumulative()], h.sum)
        yield lookups
        yield CounterMetricFamily("matinee_request_migrations",
                                  "Requests continued on another engine after theirs died.", value=self.migrations)
        yield GaugeMetricFamily("matinee_engines", "Engines this gateway routes to.", value=self._engines())
