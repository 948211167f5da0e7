"""An engine node's own HTTP port over real loopback HTTP: /metrics is this engine's, labelled with
its model and id, and keeps its last figures while the engine cannot answer; /ready is 200 only
while the node serves."""
from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from actors.nodes.engine_http import create_engine_http, start_engine_http
from actors.messages.front_end import EngineStats, GetStats
from runtime import Actor, ActorSystem
from tests.cluster.harness import free_port


class StatsOnly(Actor):
    async def receive(self, msg):
        if isinstance(msg, GetStats):
            return EngineStats(2, 1, 100, 25, 64, 48, 500, 120, 3, queue_time_buckets=[4] + [0] * 28,
                               queue_time_sum=0.002)
        return await super().receive(msg)


async def test_metrics_and_ready_of_one_engine():
    system = ActorSystem("engine-http-test")
    await system.start()
    serving = [True]
    port = free_port()
    scheduler = await system.spawn(StatsOnly(), name="scheduler")
    runner = await start_engine_http(create_engine_http(scheduler, lambda: serving[0], "tiny", "engine-7"),
                                     "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async def scrape() -> dict:
                async with http.get(base + "/metrics") as r:
                    assert r.status == 200
                    text = await r.text()
                return {(s.name, tuple(sorted(s.labels.items()))): s.value
                        for f in text_string_to_metric_families(text) for s in f.samples}

            labels = (("engine", "engine-7"), ("model_name", "tiny"))
            samples = await scrape()
            assert samples[("vllm:num_requests_running", labels)] == 2
            assert samples[("vllm:kv_cache_usage_perc", labels)] == 0.75
            assert samples[("vllm:prefix_cache_hits_total", labels)] == 48
            assert samples[("vllm:generation_tokens_total", labels)] == 120
            assert samples[("vllm:request_queue_time_seconds_count", labels)] == 4
            assert samples[("vllm:request_queue_time_seconds_bucket", tuple(sorted(labels + (("le", "0.001"),))))] == 4
            assert samples[("matinee_preemptions_total", ())] == 3
            async with http.get(base + "/ready") as r:
                assert r.status == 200 and (await r.json())["engine_id"] == "engine-7"
            serving[0] = False   # draining
            async with http.get(base + "/ready") as r:
                assert r.status == 503
            serving[0] = True
            await system.stop(scheduler)   # the engine stopped answering
            async with http.get(base + "/ready") as r:
                assert r.status == 503
            assert await scrape() == samples   # its last figures, not an error page
    finally:
        await runner.cleanup()
        await system.shutdown()
