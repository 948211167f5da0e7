"""A small Prometheus registry (counters, gauges, histograms) rendered in the text format.

The gateway's own request metrics live here; the engine's counters and gauges are copied in
from EngineStats on each scrape. No locks: everything runs on the event loop.
"""
from __future__ import annotations

import math

from prefix_store.metrics import Histogram as Buckets

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{v}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help, labels

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help, labels=()):
        super().__init__(name, help, labels)
        self.values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def set(self, value: float, *labels: str) -> None:
        """For counters kept elsewhere (the engine's cumulative stats)."""
        self.values[labels] = value

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_fmt(v)}"
                                for k, v in sorted(self.values.items())]


class Gauge(Counter):
    kind = "gauge"


class Histogram(_Metric):
    """A named, rendered histogram; the bucket counting is prefix_store's `Histogram`, so the
    router's lookup latency renders through here too (pass its counts as `values`)."""

    kind = "histogram"

    def __init__(self, name, help, buckets=LATENCY_BUCKETS, values: Buckets | None = None):
        super().__init__(name, help)
        self.values = values if values is not None else Buckets(buckets)

    def observe(self, value: float) -> None:
        self.values.observe(value)

    def render(self) -> list[str]:
        lines = self.header()
        for bound, cumulative in self.values.cumulative():
            lines.append(f'{self.name}_bucket{{le="{_fmt(bound)}"}} {cumulative}')
        lines.append(f"{self.name}_sum {_fmt(self.values.sum)}")
        lines.append(f"{self.name}_count {self.values.count}")
        return lines


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def _add(self, metric):
        self.metrics.append(metric)
        return metric

    def counter(self, name, help, labels=()) -> Counter:
        return self._add(Counter(name, help, labels))

    def gauge(self, name, help) -> Gauge:
        return self._add(Gauge(name, help))

    def histogram(self, name, help, buckets=LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help, buckets))

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"


class GatewayMetrics:
    """The metric names dashboards and tests rely on."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests_running = r.gauge("matinee_requests_running", "Requests being generated.")
        self.requests_waiting = r.gauge("matinee_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_blocks_total = r.gauge("matinee_kv_blocks_total", "KV cache blocks in the pool.")
        self.kv_blocks_free = r.gauge("matinee_kv_blocks_free", "KV cache blocks free or evictable.")
        self.kv_bytes_per_token = r.gauge("matinee_kv_bytes_per_token", "KV cache bytes per token over all "
                                          "layers (an int8/fp8 cache's scales included).")
        self.kv_token_capacity = r.gauge("matinee_kv_token_capacity", "Tokens the KV cache pool holds.")
        self.prefix_queried = r.counter("matinee_prefix_cache_queried_tokens_total",
                                        "Prompt tokens looked up in the prefix cache.")
        self.prefix_hit = r.counter("matinee_prefix_cache_hit_tokens_total",
                                    "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = r.counter("matinee_prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = r.counter("matinee_generation_tokens_total", "Tokens generated.")
        self.preemptions = r.counter("matinee_preemptions_total", "Requests preempted.")
        self.spec_draft = r.counter("matinee_spec_decode_draft_tokens_total",
                                    "Drafted tokens the target verified (speculative decoding).")
        self.spec_accepted = r.counter("matinee_spec_decode_accepted_tokens_total",
                                       "Drafted tokens the target accepted.")
        self.requests_total = r.counter("matinee_requests_total", "Finished requests.",
                                        labels=("finish_reason",))
        self.ttft = r.histogram("matinee_time_to_first_token_seconds", "Time to first token.")
        self.itl = r.histogram("matinee_inter_token_latency_seconds", "Time between tokens.")
        self.e2e = r.histogram("matinee_e2e_request_latency_seconds", "Request latency, end to end.")
        self.queue = r.histogram("matinee_request_queue_seconds",
                                 "Time from arrival until the request was handed to the engine "
                                 "(validation, templating, tokenization).")

    def update_engine(self, stats) -> None:
        self.requests_running.set(stats.requests_running)
        self.requests_waiting.set(stats.requests_waiting)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_blocks_free.set(stats.kv_blocks_free)
        self.kv_bytes_per_token.set(stats.kv_bytes_per_token)
        self.kv_token_capacity.set(stats.kv_token_capacity)
        self.prefix_queried.set(stats.prefix_cache_queried_tokens)
        self.prefix_hit.set(stats.prefix_cache_hit_tokens)
        self.prompt_tokens.set(stats.prompt_tokens)
        self.generation_tokens.set(stats.generation_tokens)
        self.preemptions.set(stats.preemptions)
        self.spec_draft.set(stats.spec_decode_draft_tokens)
        self.spec_accepted.set(stats.spec_decode_accepted_tokens)

    def render(self) -> str:
        return self.registry.render()
