"""The cluster's own metrics, in Prometheus text: routing decisions by reason, prefix-index
lookup latency, request migrations and live engines. Appended to the gateway's /metrics."""

from __future__ import annotations

from collections.abc import Callable

from gateway.metrics import Histogram
from prefix_store import RoutingMetrics


class PoolMetrics:
    def __init__(self, routing: RoutingMetrics, engines: Callable[[], int] = lambda: 0):
        self.routing = routing
        self.migrations = 0
        self._engines = engines

    def render(self) -> str:
        r = self.routing
        lines = ["# HELP matinee_routing_decisions_total Requests routed, by why the engine was chosen.",
                 "# TYPE matinee_routing_decisions_total counter"]
        lines += [f'matinee_routing_decisions_total{{reason="{k}"}} {v}' for k, v in sorted(r.decisions.items())]
        lines += ["# HELP matinee_prefix_index_lookup_errors_total Failed or timed-out index lookups.",
                  "# TYPE matinee_prefix_index_lookup_errors_total counter",
                  f"matinee_prefix_index_lookup_errors_total {r.lookup_errors}",
                  "# HELP matinee_routed_prefix_blocks_total Prompt blocks routed, and those the chosen "
                  "engine was expected to hold.",
                  "# TYPE matinee_routed_prefix_blocks_total counter",
                  f'matinee_routed_prefix_blocks_total{{kind="requested"}} {r.blocks_requested}',
                  f'matinee_routed_prefix_blocks_total{{kind="matched"}} {r.blocks_matched}']
        lines += Histogram("matinee_prefix_index_lookup_seconds", "Prefix index lookup latency.",
                           values=r.lookup_seconds).render()
        lines += ["# HELP matinee_request_migrations_total Requests continued on another engine "
                  "after theirs died.",
                  "# TYPE matinee_request_migrations_total counter",
                  f"matinee_request_migrations_total {self.migrations}",
                  "# HELP matinee_engines Engines this gateway routes to.",
                  "# TYPE matinee_engines gauge",
                  f"matinee_engines {self._engines()}"]
        return "\n".join(lines) + "\n"
