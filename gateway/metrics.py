"""The gateway's /metrics: its own request metrics, under Matinee's names and vLLM's (with
`model_name`), in one prometheus_client registry per app; and, when the engine runs in this
process, the engine's (actors/stats/engine_metrics.py) copied from EngineStats on each scrape.

In a cluster every engine serves its own /metrics, so a gateway renders only what it measured
itself: summing engines here would count each once per gateway. No locks: the event loop owns it.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from actors.stats.engine_metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, EngineCollector
from actors.stats.recent import RecentSamples
from gateway.engine_connection import EngineConnection

disable_created_metrics()   # no `_created` series: Matinee's and vLLM's dashboards read none

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
VLLM_LABELS = ("model_name",)


class Latency:
    """One latency under both names: Matinee's histogram and vLLM's (labelled with the model)."""

    def __init__(self, registry: CollectorRegistry, name: str, help: str, vllm_buckets=None,
                 vllm_name: str | None = None) -> None:
        self.matinee = Histogram(f"matinee_{name}", help, buckets=LATENCY_BUCKETS, registry=registry)
        self.vllm = None if vllm_buckets is None else Histogram(
            f"vllm:{vllm_name or name}", help, VLLM_LABELS, buckets=vllm_buckets, registry=registry)
        self.model_name = ""
        self.recent = RecentSamples()   # the dashboard's p50 and p90 of the last seconds

    def observe(self, value: float, times: int = 1) -> None:
        for _ in range(times):
            self.matinee.observe(value)
            if self.vllm is not None:
                self.vllm.labels(self.model_name).observe(value)
        self.recent.add(value, times)


class _Untimed:
    def observe(self, value: float, times: int = 1) -> None:
        pass


class BatchLineMetrics:
    """What a batch line's Generation reports: its finish, not its latencies. Ballast waits by
    design; the latency histograms and the dashboard's tiles are interactive requests' alone."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.finished = metrics.finished
        self.ttft = self.itl = self.e2e = self.queue = _Untimed()


class GatewayMetrics:
    """The metric names dashboards and tests rely on."""

    def __init__(self, engine_in_process: bool = True) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = ""
        self.engine = EngineCollector() if engine_in_process else None
        if self.engine is not None:
            r.register(self.engine)
        self.ttft = Latency(r, "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = Latency(r, "inter_token_latency_seconds", "Time between tokens, observed per token.",
                           ITL_BUCKETS)
        self.e2e = Latency(r, "e2e_request_latency_seconds", "Request latency, end to end.",
                           REQUEST_LATENCY_BUCKETS)
        self.queue = Latency(r, "request_queue_seconds", "Time from arrival until the request was handed to "
                             "the engine (validation, templating, tokenization).")
        self._finished = Counter("matinee_requests", "Finished requests.", ("finish_reason",), registry=r)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                VLLM_LABELS + ("finished_reason",), registry=r)
        self._batch_lines = Counter("matinee_batch_lines", "Batch lines answered (/v1/batches), by outcome: "
                                    "completed (200) or failed (in the error file).", ("outcome",), registry=r)
        self._batches = Counter("matinee_batches_ended", "Batches that ended, by their final status.",
                                ("status",), registry=r)

    def set_model(self, name: str, engine: str = "0") -> None:
        self.model_name = name
        for latency in (self.ttft, self.itl, self.e2e, self.queue):
            latency.model_name = name
        if self.engine is not None:
            self.engine.model_name, self.engine.engine = name, engine

    def finished(self, reason: str, n: int = 1) -> None:
        self._finished.labels(reason).inc(n)
        if reason in ("stop", "length", "abort"):   # vLLM's finished_reason values
            self._success.labels(self.model_name, reason).inc(n)

    def of(self, ballast: bool) -> GatewayMetrics | BatchLineMetrics:
        """The metrics a Generation reports to: a batch line's finish only (see BatchLineMetrics)."""
        return BatchLineMetrics(self) if ballast else self

    def batch_line(self, ok: bool) -> None:
        self._batch_lines.labels("completed" if ok else "failed").inc()

    def batch_ended(self, status: str) -> None:
        self._batches.labels(status).inc()

    def update_engine(self, stats) -> None:
        if self.engine is not None:
            self.engine.update(stats)

    async def refresh(self, client: EngineConnection | None) -> None:
        """Before a scrape: the in-process engine's latest stats (a slow or gone engine keeps the last)."""
        if self.engine is None or client is None or not client.alive:
            return
        try:
            for stats in (await client.engine_stats(timeout=2.0)).values():   # the one engine's
                self.update_engine(stats)
        except Exception:   # a slow or gone engine must not break scraping of the rest
            pass

    def render(self) -> str:
        return generate_latest(self.registry).decode()
