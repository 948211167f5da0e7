"""Two gateways and two engines as processes, each scraped on its own /metrics as Prometheus
scrapes every replica: the sums across processes equal what was served, no gateway repeats an
engine's counters, and an engine leaving makes no counter anywhere fall."""
from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import harness as h

pytestmark = pytest.mark.slow


def scrape(base: str) -> dict[tuple, float]:
    """Every sample of /metrics, by (name, labels)."""
    status, text = h.http_json("GET", base + "/metrics")
    assert status == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(str(text)) for s in f.samples}


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def counters(samples: dict) -> dict:
    return {k: v for k, v in samples.items() if k[0].endswith(("_total", "_count", "_sum", "_bucket"))}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("metrics-tiny")))


def test_two_gateways_and_two_engines_sum_per_process(model, tmp_path):
    redis = h.RedisServer()
    redis.start()
    engines, gateways = {}, {}
    try:
        for _ in range(2):
            port, http = h.free_port(), h.free_port()
            engines[http] = h.Node(h.engine_args(model, redis.url, port) + ["--metrics-port", str(http)],
                                   str(tmp_path / f"engine-{port}.log")).start()
        for _ in range(2):
            port = h.free_port()
            gateways[port] = h.Node(h.gateway_args(model, redis.url, port, "--routing", "round_robin"),
                                    str(tmp_path / f"gateway-{port}.log")).start()
        nodes = [*engines.values(), *gateways.values()]
        engine_urls = [f"http://127.0.0.1:{p}" for p in engines]
        gateway_urls = [f"http://127.0.0.1:{p}" for p in gateways]
        for url in gateway_urls:
            h.wait_until(lambda: h.metric(url, "matinee_engines") == 2, 180, "2 engines behind a gateway", nodes)
        for url in engine_urls:
            h.wait_until(lambda: h.http_json("GET", url + "/ready")[0] == 200, 30, "an engine ready", nodes)

        served = {url: 0 for url in gateway_urls}
        for i in range(6):
            url = gateway_urls[i % 2] if i < 4 else gateway_urls[0]
            status, body = h.http_json("POST", url + "/v1/completions",
                                       {"model": "tiny", "prompt": [5, 6, 7, 8 + i], "max_tokens": 4,
                                        "temperature": 0, "ignore_eos": True})
            assert status == 200, body
            served[url] += 1

        per_engine = [scrape(u) for u in engine_urls]
        per_gateway = [scrape(u) for u in gateway_urls]
        assert sum(total(s, "vllm:generation_tokens_total") for s in per_engine) == 6 * 4
        assert sum(total(s, "matinee_generation_tokens_total") for s in per_engine) == 6 * 4
        assert all(total(s, "vllm:generation_tokens_total") > 0 for s in per_engine)   # round robin: both
        assert sum(total(s, "vllm:request_queue_time_seconds_count") for s in per_engine) == 6
        assert sum(total(s, "matinee_engine_time_to_first_token_seconds_count") for s in per_engine) == 6
        assert sum(total(s, "matinee_engine_inter_token_latency_seconds_count") for s in per_engine) == 6 * 3
        for s in per_engine:
            assert {dict(k[1]).get("model_name") for k in s if k[0].startswith("vllm:")} == {model.rsplit("/", 1)[-1]}
        for url, s in zip(gateway_urls, per_gateway):
            assert total(s, "matinee_requests_total") == served[url]
            assert total(s, "vllm:e2e_request_latency_seconds_count") == served[url]
            assert not any(n.startswith(("vllm:generation", "matinee_generation", "vllm:num_requests", "matinee_engine_"))
                           for n, _ in s), "a gateway repeats the engines' own metrics"

        # Each gateway's dashboard stream shows every engine it routes to, each with its own counters
        # (as the gateway last polled them: a snapshot or two may lag).
        for url in gateway_urls:
            with urllib.request.urlopen(url + "/dashboard/stream", timeout=30) as r:
                events = (json.loads(line[6:]) for line in r if line.startswith(b"data: "))
                for _, snapshot in zip(range(20), events):
                    if sum(e["generation_tokens"] for e in snapshot["engines"].values()) == 6 * 4:
                        break
                else:
                    raise AssertionError(f"the stream never showed the 24 tokens generated: {snapshot}")
            assert sorted(snapshot["engines"]) == sorted(f"engine-{n.args[n.args.index('--listen-port') + 1]}"
                                                         for n in engines.values())

        # One engine leaves (drains and exits): what every remaining process counted stays.
        leaving = engine_urls[0]
        assert engines[int(leaving.rsplit(":", 1)[1])].terminate(timeout=60) == 0
        for url in gateway_urls:
            h.wait_until(lambda: h.metric(url, "matinee_engines") == 1, 30, "the engine gone", nodes)
        status, body = h.http_json("POST", gateway_urls[1] + "/v1/completions",
                                   {"model": "tiny", "prompt": [9, 9, 9], "max_tokens": 2, "ignore_eos": True})
        assert status == 200, body
        for before, url in [*zip(per_gateway, gateway_urls), (per_engine[1], engine_urls[1])]:
            after = counters(scrape(url))
            fell = {k: (v, after.get(k)) for k, v in counters(before).items() if after.get(k, -1) < v}
            assert fell == {}, f"counters fell on {url}"
    finally:
        for node in [*engines.values(), *gateways.values()]:
            node.kill()
        redis.stop()
