"""The cluster's own metrics, in Prometheus text: routing decisions by reason, prefix-index
lookup latency, request migrations, live engines, and KV handoffs between prefill and decode
engines (the engines' counters summed). Appended to the gateway's /metrics."""

from __future__ import annotations

from collections.abc import Callable

from actors.messages import EngineStats
from gateway.metrics import Histogram
from prefix_store import RoutingMetrics


class PoolMetrics:
    def __init__(self, routing: RoutingMetrics, engines: Callable[[], int] = lambda: 0,
                 totals: Callable[[], EngineStats | None] = lambda: None):
        self.routing = routing
        self.migrations = 0
        self.handoffs = 0           # requests a decode engine took over
        self.handoff_failures = 0   # handoffs cut on the way (refusals of a full engine not counted)
        self._engines = engines
        self._totals = totals

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
        lines += self._handoff_lines()
        return "\n".join(lines) + "\n"

    def _handoff_lines(self) -> list[str]:
        t = self._totals()
        lines = ["# HELP matinee_kv_handoffs_total Requests handed from a prefill to a decode engine.",
                 "# TYPE matinee_kv_handoffs_total counter",
                 f'matinee_kv_handoffs_total{{outcome="handed_over"}} {self.handoffs}',
                 f'matinee_kv_handoffs_total{{outcome="failed"}} {self.handoff_failures}']
        if t is None:
            return lines
        return lines + [
            "# HELP matinee_kv_handoff_refusals_total Handoffs a full decode engine refused.",
            "# TYPE matinee_kv_handoff_refusals_total counter",
            f"matinee_kv_handoff_refusals_total {t.kv_handoffs_refused}",
            "# HELP matinee_kv_transfer_blocks_total KV blocks sent by prefill engines.",
            "# TYPE matinee_kv_transfer_blocks_total counter",
            f"matinee_kv_transfer_blocks_total {t.kv_transfer_blocks}",
            "# HELP matinee_kv_transfer_bytes_total KV bytes sent by prefill engines.",
            "# TYPE matinee_kv_transfer_bytes_total counter",
            f"matinee_kv_transfer_bytes_total {t.kv_transfer_bytes}",
            "# HELP matinee_kv_transfer_seconds_total Time from offer to commit, summed over handoffs.",
            "# TYPE matinee_kv_transfer_seconds_total counter",
            f"matinee_kv_transfer_seconds_total {t.kv_transfer_s:.6f}",
            "# HELP matinee_ttft_split_seconds_total Time to the first token on the engine that "
            "sampled it, summed: queue, then prefill.",
            "# TYPE matinee_ttft_split_seconds_total counter",
            f'matinee_ttft_split_seconds_total{{part="queue"}} {t.ttft_queue_s:.6f}',
            f'matinee_ttft_split_seconds_total{{part="prefill"}} {t.ttft_prefill_s:.6f}',
            "# HELP matinee_prefill_steps_total Steps that computed prompt tokens, summed over engines.",
            "# TYPE matinee_prefill_steps_total counter",
            f"matinee_prefill_steps_total {t.prefill_steps}"]
