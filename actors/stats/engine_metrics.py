"""The engine's metrics in Prometheus form, from its latest EngineStats: Matinee's names and vLLM's.

A prometheus_client collector, served by the one process that runs the engine (the embedded
gateway's /metrics, or an engine node's own HTTP port), so a scrape per process never counts an
engine twice. Adding a metric is one row in `SERIES`.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from actors.messages.front_end import EngineStats

# vLLM's request-latency buckets (queue, e2e): 0.3 s to a little over 2 hours.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Finer at the bottom than vLLM's: on an idle engine a request waits well under 0.3 s.
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2) + REQUEST_LATENCY_BUCKETS
# vLLM's first-token and inter-token buckets (the gateway's histograms and the engine's own).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)


def model_name_from_path(path: str) -> str:
    """The model's name as clients and `model_name` labels see it: the folder's or file's name; a
    hub cache's snapshot folder is named by its repo id (org/name)."""
    parts = os.path.normpath(path).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    base = os.path.basename(os.path.normpath(path)) or path
    return base.removesuffix(".gguf").split(".Q")[0] if base.endswith(".gguf") else base


def kv_usage(s: EngineStats) -> float:
    """The fraction of the KV pool held by sequences (free and evictable blocks are not)."""
    return 1.0 - s.kv_blocks_free / s.kv_blocks_total if s.kv_blocks_total else 0.0


def _tier(name: str) -> Callable[[EngineStats], float]:
    """A KV tier stat (0 without a tier)."""
    return lambda s: getattr(s.kv_tier, name) if s.kv_tier is not None else 0


@dataclass(frozen=True)
class Series:
    name: str                              # counters without `_total`: the exposition adds it
    kind: str                              # "counter" or "gauge"
    help: str
    value: Callable[[EngineStats], float]
    vllm: bool = False                     # labelled with model_name and engine, as vLLM's are


SERIES = (
    Series("matinee_requests_running", "gauge", "Requests being generated.", lambda s: s.requests_running),
    Series("matinee_requests_waiting", "gauge", "Requests waiting to be scheduled.", lambda s: s.requests_waiting),
    Series("matinee_kv_blocks_total", "gauge", "KV cache blocks in the pool.", lambda s: s.kv_blocks_total),
    Series("matinee_kv_blocks_free", "gauge", "KV cache blocks free or evictable.", lambda s: s.kv_blocks_free),
    Series("matinee_model_weight_bytes", "gauge", "Model weight bytes resident (quantized or not).",
           lambda s: s.weight_bytes),
    Series("matinee_kv_bytes_per_token", "gauge", "KV cache bytes per token over all layers (an int8 or fp8 "
           "cache's scales included).", lambda s: s.kv_bytes_per_token),
    Series("matinee_kv_token_capacity", "gauge", "Tokens the KV cache pool holds.", lambda s: s.kv_token_capacity),
    Series("matinee_prefix_cache_queried_tokens", "counter", "Prompt tokens looked up in the prefix cache.",
           lambda s: s.prefix_cache_queried_tokens),
    Series("matinee_prefix_cache_hit_tokens", "counter", "Prompt tokens served from the prefix cache.",
           lambda s: s.prefix_cache_hit_tokens),
    Series("matinee_prefix_cache_tier_hit_tokens", "counter", "Of those, prompt tokens copied back from the KV "
           "tier (--kv-offload-memory / --kv-offload-dir) instead of computed.",
           lambda s: s.prefix_cache_tier_hit_tokens),
    Series("matinee_prefix_pulls_skipped", "counter", "Prefix pulls a peer could have given that the measured "
           "rates said to compute instead.", lambda s: s.prefix_pulls_skipped),
    Series("matinee_prefill_rate_tokens_per_second", "gauge", "Prompt tokens a second of forward, smoothed over "
           "the steps that prefilled (0 until measured; what a pull is weighed against).",
           lambda s: s.prefill_tokens_per_s),
    Series("matinee_prefix_pull_rate_bytes_per_second", "gauge", "KV bytes a second of the prefix pulls, smoothed "
           "(0 until one moved a block).", lambda s: s.pull_bytes_per_s),
    *(Series(f"matinee_kv_tier_{name}", kind, text, _tier(field)) for name, kind, text, field in (
        ("hit_blocks_memory", "counter", "KV blocks copied back from the tier's host memory.", "tier_hits_memory"),
        ("hit_blocks_disk", "counter", "KV blocks copied back from the tier's disk store.", "tier_hits_disk"),
        ("hit_blocks_disk_read_ahead", "counter", "Of those from disk, blocks read ahead from their request's "
         "arrival (its step waits for no more than what is left of that read).", "tier_hits_read_ahead"),
        ("saved_bytes", "counter", "KV bytes copied out of the pool into the tier on eviction.", "tier_bytes_saved"),
        ("loaded_bytes", "counter", "KV bytes copied back from the tier into the pool.", "tier_bytes_loaded"),
        ("pulled_bytes", "counter", "KV bytes pulled from peer engines into the tier.", "tier_bytes_pulled"),
        ("pulls", "counter", "Prefix pulls from peer engines.", "tier_pulls"),
        ("pull_failures", "counter", "Prefix pulls that failed (the prompt was computed).", "tier_pull_failures"),
        ("pull_seconds", "counter", "Time pulling prefixes from peer engines, summed.", "tier_pull_s"),
        ("load_seconds", "counter", "Time reading tier blocks and copying them back, summed.", "tier_load_s"),
        ("blocks", "gauge", "KV blocks the tier holds (memory or disk).", "tier_blocks"),
        ("memory_bytes", "gauge", "Host memory the tier's blocks take.", "tier_memory_bytes"),
        ("disk_bytes", "gauge", "Disk the tier's block files take.", "tier_disk_bytes"),
        ("write_failures", "counter", "Blocks the disk tier could not write (a full disk) or dropped (its writer "
         "behind).", "tier_write_failures"),
        ("discarded_blocks", "counter", "Damaged or truncated tier block files deleted instead of served.",
         "tier_discarded"))),
    Series("matinee_prompt_tokens", "counter", "Prompt tokens processed.", lambda s: s.prompt_tokens),
    Series("matinee_generation_tokens", "counter", "Tokens generated.", lambda s: s.generation_tokens),
    Series("matinee_preemptions", "counter", "Requests preempted.", lambda s: s.preemptions),
    Series("matinee_engine_steps", "counter", "Steps the engine ran (each decode step of a burst counts).",
           lambda s: s.steps),
    Series("matinee_batch_rows", "counter", "Batch-line (ballast) sequences in a step, summed over steps: over "
           "matinee_engine_steps, the batch rows per step.", lambda s: s.ballast_rows),
    Series("matinee_batch_requests_finished", "counter", "Batch-line requests the engine finished.",
           lambda s: s.ballast_finished),
    Series("matinee_spec_decode_draft_tokens", "counter",
           "Drafted tokens the target verified (speculative decoding).", lambda s: s.spec_decode_draft_tokens),
    Series("matinee_spec_decode_accepted_tokens", "counter", "Drafted tokens the target accepted.",
           lambda s: s.spec_decode_accepted_tokens),
    Series("matinee_prefill_steps", "counter", "Steps that computed prompt tokens (a decode engine's "
           "only recompute preempted ones).", lambda s: s.prefill_steps),
    Series("matinee_kv_handoffs_sent", "counter", "Requests whose KV this engine handed to a decode engine.",
           lambda s: s.kv_handoffs_sent),
    Series("matinee_kv_handoffs_received", "counter", "Requests a prefill engine handed to this engine.",
           lambda s: s.kv_handoffs_received),
    Series("matinee_kv_handoffs_failed", "counter", "Handoffs this engine sent that were cut or refused.",
           lambda s: s.kv_handoffs_failed),
    Series("matinee_kv_handoffs_refused", "counter", "Handoffs this engine refused for want of KV room.",
           lambda s: s.kv_handoffs_refused),
    Series("matinee_kv_transfer_blocks", "counter", "KV blocks this engine sent in handoffs.",
           lambda s: s.kv_transfer_blocks),
    Series("matinee_kv_transfer_blocks_ahead", "counter", "Of those, blocks sent while their prompt was "
           "still being computed.", lambda s: s.kv_transfer_blocks_ahead),
    Series("matinee_kv_transfer_bytes", "counter", "KV bytes this engine sent in handoffs.",
           lambda s: s.kv_transfer_bytes),
    Series("matinee_kv_transfer_bytes_ahead", "counter", "Of those, bytes sent while their prompt was "
           "still being computed (whole blocks, and layers as the forward wrote them).",
           lambda s: s.kv_transfer_bytes_ahead),
    Series("matinee_kv_transfer_seconds", "counter", "Handoff time from the first token to the commit, summed.",
           lambda s: s.kv_transfer_s),
    Series("matinee_ttft_queue_seconds", "counter", "Arrival to first scheduled, summed over first tokens "
           "sampled here.", lambda s: s.ttft_queue_s),
    Series("matinee_ttft_prefill_seconds", "counter", "First scheduled to first token, summed over first "
           "tokens sampled here.", lambda s: s.ttft_prefill_s),
    Series("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
           lambda s: s.requests_running, vllm=True),
    Series("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           lambda s: s.requests_waiting, vllm=True),
    Series("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", kv_usage, vllm=True),
    Series("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
           lambda s: s.prefix_cache_queried_tokens, vllm=True),
    Series("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
           lambda s: s.prefix_cache_hit_tokens, vllm=True),
    Series("vllm:num_preemptions", "counter", "Cumulative number of preemptions from the engine.",
           lambda s: s.preemptions, vllm=True),
    Series("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", lambda s: s.prompt_tokens,
           vllm=True),
    Series("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
           lambda s: s.generation_tokens, vllm=True),
    Series("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts.",
           lambda s: s.spec_decode_num_drafts, vllm=True),
    Series("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.",
           lambda s: s.spec_decode_draft_tokens, vllm=True),
    Series("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.",
           lambda s: s.spec_decode_accepted_tokens, vllm=True),
)


class EngineCollector(Collector):
    """Renders the stats last given to `update`; nothing before the first."""

    def __init__(self, model_name: str = "", engine: str = "0") -> None:
        self.model_name, self.engine = model_name, engine
        self.stats: EngineStats | None = None

    def update(self, stats: EngineStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator:
        s = self.stats
        if s is None:
            return
        labels = {"model_name": self.model_name, "engine": self.engine}
        for series in SERIES:
            family = CounterMetricFamily if series.kind == "counter" else GaugeMetricFamily
            if series.vllm:
                metric = family(series.name, series.help, labels=list(labels))
                metric.add_metric(list(labels.values()), series.value(s))
            else:
                metric = family(series.name, series.help, value=series.value(s))
            yield metric
        yield _histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                         labels, QUEUE_TIME_BUCKETS, s.queue_time_buckets, s.queue_time_sum)
        # The same latencies as the gateway's vLLM histograms, but as this engine saw them, per
        # engine: under Matinee's names, so no sum over processes counts a request twice.
        yield _histogram("matinee_engine_time_to_first_token_seconds", "Arrival at the engine's scheduler to "
                         "its first token sampled.", labels, TTFT_BUCKETS, s.ttft_buckets, s.ttft_sum)
        yield _histogram("matinee_engine_inter_token_latency_seconds", "Time between the engine's tokens of a "
                         "sequence, observed per token.", labels, ITL_BUCKETS, s.itl_buckets, s.itl_sum)
        yield from self._accepted_per_pos(s, labels)
        yield from _lora(s)

    @staticmethod
    def _accepted_per_pos(s: EngineStats, labels: dict[str, str]) -> Iterator[CounterMetricFamily]:
        """Accepted drafted tokens by draft position, one sample per position the engine drafts
        (as vLLM's, none without speculative decoding); the positions sum to the accepted tokens."""
        if not s.spec_decode_accepted_per_pos:
            return
        matinee = CounterMetricFamily("matinee_spec_decode_accepted_tokens_per_pos",
                                      "Drafted tokens the target accepted, by position in the draft.",
                                      labels=["position"])
        vllm = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                   "Accepted tokens per draft position.", labels=[*labels, "position"])
        for pos, n in enumerate(s.spec_decode_accepted_per_pos):
            matinee.add_metric([str(pos)], n)
            vllm.add_metric([*labels.values(), str(pos)], n)
        yield matinee
        yield vllm


def _lora(s: EngineStats) -> Iterator:
    """vLLM's vllm:lora_requests_info (its labels name the adapters running and waiting, its value is
    when it was last updated) and Matinee's requests per adapter; none while LoRA is off."""
    if not s.max_loras:
        return
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
    info.add_metric([",".join(sorted(s.lora_running)), str(s.max_loras), ",".join(sorted(s.lora_waiting))],
                    time.time())
    yield info
    requests = CounterMetricFamily("matinee_lora_requests", "Requests submitted for each LoRA adapter.",
                                   labels=["lora_name"])
    running = GaugeMetricFamily("matinee_lora_requests_running", "Requests running with each LoRA adapter.",
                                labels=["lora_name"])
    for name, n in sorted(s.lora_requests.items()):
        requests.add_metric([name], n)
        running.add_metric([name], s.lora_running.get(name, 0))
    yield requests
    yield running


def _histogram(name: str, help: str, labels: dict[str, str], bounds: tuple[float, ...], counts: list[int],
               total: float) -> HistogramMetricFamily:
    """An engine histogram from its per-bucket counts (bounds, then +Inf), all zero before any."""
    metric = HistogramMetricFamily(name, help, labels=list(labels))
    counts = counts or [0] * (len(bounds) + 1)
    cumulative, running = [], 0
    for bound, n in zip((*bounds, float("inf")), counts):
        running += n
        cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
    metric.add_metric(list(labels.values()), cumulative, total)
    return metric
