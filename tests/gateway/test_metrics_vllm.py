"""/metrics of a live embedded server: it parses with prometheus_client, carries vLLM's names with
`model_name`, vLLM's bucket ranges, gauges without `_total`, the queue time measured in the engine,
and inter-token latency observed once per token even where a delta carries several."""
from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import ITL_BUCKETS, TTFT_BUCKETS

VLLM_GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
VLLM_COUNTERS = {"vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:num_preemptions", "vllm:request_success",
                 "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens"}
VLLM_HISTOGRAMS = {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"}


def scrape(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def value(families: dict, family: str, sample: str) -> float:
    return sum(s.value for s in families[family].samples if s.name == sample)


def complete(base: str, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    req = urllib.request.Request(base + "/v1/completions", body.encode(), {"Content-Type": "application/json"})
    usage = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


@pytest.fixture(scope="module")
def spec_server(tiny_model_folder):
    """A tiny engine that drafts by n-gram lookup, so deltas carry several tokens."""
    from actors.config import EngineConfig
    from gateway.config import GatewayConfig
    from tests.gateway.live import LiveServer

    live = LiveServer(EngineConfig(model=tiny_model_folder, dtype="float32", num_blocks=256, num_threads=1,
                                   speculative={"method": "ngram", "num_speculative_tokens": 4,
                                                "adaptive": False, "disable_batch_size": None}))
    live.start()
    try:
        yield live.add_app(GatewayConfig(served_model_name="tiny"))
    finally:
        live.stop()


def test_vllm_names_labels_and_buckets(spec_server):
    complete(spec_server, [5, 6, 7, 8] * 6, 8)
    families = scrape(spec_server)
    for name, kind in [*((n, "gauge") for n in VLLM_GAUGES), *((n, "counter") for n in VLLM_COUNTERS),
                       *((n, "histogram") for n in VLLM_HISTOGRAMS)]:
        assert name in families and families[name].type == kind, name
        for s in families[name].samples:
            assert s.labels.get("model_name") == "tiny", (name, s.labels)
            assert not (kind == "gauge" and s.name.endswith("_total")), s.name
            assert kind != "counter" or s.name == name + "_total", s.name
    bounds = {n: [float(s.labels["le"]) for s in families[n].samples if s.name == n + "_bucket"]
              for n in VLLM_HISTOGRAMS}
    assert bounds["vllm:time_to_first_token_seconds"][:-1] == list(TTFT_BUCKETS)
    assert bounds["vllm:inter_token_latency_seconds"][:-1] == list(ITL_BUCKETS)
    for name, buckets in (("matinee_engine_time_to_first_token_seconds", TTFT_BUCKETS),
                          ("matinee_engine_inter_token_latency_seconds", ITL_BUCKETS)):
        assert families[name].type == "histogram"
        samples = families[name].samples
        assert [float(s.labels["le"]) for s in samples if s.name == name + "_bucket"][:-1] == list(buckets)
        assert all(set(s.labels) - {"le"} == {"model_name", "engine"} for s in samples)
    assert max(bounds["vllm:e2e_request_latency_seconds"][:-1]) >= 7680
    assert max(bounds["vllm:request_queue_time_seconds"][:-1]) >= 7680
    # The queue time is the engine's: one observation per request it scheduled.
    assert value(families, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") >= 1
    assert value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") >= 8
    assert value(families, "matinee_generation_tokens", "matinee_generation_tokens_total") >= 8


def test_inter_token_latency_is_observed_per_token(spec_server):
    before = scrape(spec_server)
    usage = complete(spec_server, [9, 10, 11, 12, 13] * 8, 40)
    after = scrape(spec_server)

    def delta(family, sample):
        return value(after, family, sample) - value(before, family, sample)

    accepted = delta("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted > 0, "the n-gram drafts were never accepted: no delta carried several tokens"
    itl = delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count")
    assert itl == usage["completion_tokens"] - 1
    assert delta("matinee_inter_token_latency_seconds", "matinee_inter_token_latency_seconds_count") == itl
    queue = delta("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count")
    assert queue == 1
    # The engine's own: one first token, and one inter-token observation per token after it.
    assert delta("matinee_engine_time_to_first_token_seconds", "matinee_engine_time_to_first_token_seconds_count") == 1
    assert delta("matinee_engine_inter_token_latency_seconds", "matinee_engine_inter_token_latency_seconds_count") == itl
    assert delta("matinee_engine_inter_token_latency_seconds", "matinee_engine_inter_token_latency_seconds_sum") > 0


def test_accepted_tokens_per_draft_position_as_vllm_counts_them(spec_server):
    complete(spec_server, [9, 10, 11, 12, 13] * 8, 40)
    families = scrape(spec_server)
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    family = families[name]
    assert family.type == "counter"
    accepted = families["vllm:spec_decode_num_accepted_tokens"].samples
    assert len(accepted) == 1
    per_pos = {}
    for s in family.samples:
        assert s.name == name + "_total", s.name
        assert set(s.labels) == {"model_name", "engine", "position"}, s.labels   # vLLM's labels
        assert {k: v for k, v in s.labels.items() if k != "position"} == accepted[0].labels
        per_pos[int(s.labels["position"])] = s.value
    assert sorted(per_pos) == [0, 1, 2, 3]   # every position of num_speculative_tokens=4, as vLLM's
    assert sum(per_pos.values()) == accepted[0].value > 0
    assert all(per_pos[j] >= per_pos[j + 1] for j in range(3))   # a kept draft token's earlier ones were kept
    assert per_pos[0] <= value(families, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total")
    ours = {int(s.labels["position"]): s.value for s in families["matinee_spec_decode_accepted_tokens_per_pos"].samples}
    assert ours == per_pos
