"""The router over real stores: prefix routing, and no failed request when Redis dies or stalls."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aredis

from prefix_store import EngineLoad, PrefixRouter, RedisPrefixStore
from tests.prefix_store.conftest import FakeClock

LOADS = [EngineLoad("a", requests_running=1), EngineLoad("b"), EngineLoad("c", requests_running=3)]
PROMPT = [b"p1", b"p2", b"p3", b"p4"]



async def test_routes_to_the_engine_holding_the_prefix_and_counts_why(store):
    await store.publish_snapshot("a", PROMPT[:3], 0)
    await store.publish_snapshot("c", PROMPT[:1], 0)
    router = PrefixRouter(store, timeout_s=1.0)
    decision = await router.route(PROMPT, lambda: LOADS)
    assert (decision.engine_id, decision.reason, decision.matched_blocks) == ("a", "prefix", 3)
    # A prompt nobody holds goes by load; one shorter than a block too, without a fallback.
    assert (await router.route([b"other"], lambda: LOADS)).reason == "load"
    assert (await router.route([], lambda: LOADS)).engine_id == "b"
    m = router.metrics
    assert dict(m.decisions) == {"prefix": 1, "load": 2}
    assert (m.blocks_requested, m.blocks_matched) == (5, 3)
    assert m.lookup_seconds.count == 2  # the empty prompt needs no lookup
    assert m.lookup_seconds.cumulative()[-1] == (float("inf"), 2)
    assert m.lookup_errors == 0


async def test_without_an_index_routing_is_least_loaded():
    router = PrefixRouter(None)
    decision = await router.route(PROMPT, lambda: LOADS)
    assert (decision.engine_id, decision.reason) == ("b", "fallback")


async def test_redis_stopped_mid_run_falls_back_within_the_timeout(private_redis):
    clock = FakeClock()
    store = RedisPrefixStore.from_url(private_redis.url, namespace="t", ttl_s=10)
    router = PrefixRouter(store, timeout_s=0.2, cooldown_s=5.0, clock=clock)
    await store.publish_snapshot("a", PROMPT, 0)
    assert (await router.route(PROMPT, lambda: LOADS)).reason == "prefix"

    private_redis.stop()
    for _ in range(20):
        start = time.perf_counter()
        decision = await router.route(PROMPT, lambda: LOADS)
        # Bounded by the router's own deadline (plus scheduling slack on a busy machine).
        assert time.perf_counter() - start < 0.2 + 0.3
        assert (decision.engine_id, decision.reason) == ("b", "fallback")
    assert router.metrics.decisions["fallback"] == 20
    # After the first failure the index is skipped, not retried per request.
    assert router.metrics.lookup_errors == 1

    # Redis comes back (empty) on the same port: after the cool-down, routing uses it again.
    private_redis.start()
    clock.now += 5.0
    await store.publish_snapshot("c", PROMPT, 0)
    assert (await router.route(PROMPT, lambda: LOADS)).engine_id == "c"
    await store.close()


async def test_a_stalled_redis_costs_one_timeout_and_leaves_no_stale_reply(private_redis):
    clock = FakeClock()
    store = RedisPrefixStore.from_url(private_redis.url, namespace="t", ttl_s=10)
    await store.publish_snapshot("a", PROMPT, 0)
    router = PrefixRouter(store, timeout_s=0.05, cooldown_s=1.0, clock=clock)
    admin = aredis.Redis.from_url(private_redis.url)
    await admin.ping()  # connected, so the stall below reaches the server at once
    stall = asyncio.create_task(admin.execute_command("DEBUG", "SLEEP", "0.6"))
    await asyncio.sleep(0.1)  # the server is now asleep

    start = time.perf_counter()
    decision = await router.route(PROMPT, lambda: LOADS)
    assert time.perf_counter() - start < 0.05 + 0.3
    assert decision.reason == "fallback"
    await stall
    await admin.aclose()

    # The cancelled lookup's late reply must not be read as the next command's answer.
    clock.now += 1.0
    await store.publish_snapshot("c", PROMPT[:2], 0)
    assert await store.match(PROMPT) == {"a": 4, "c": 2}
    assert (await router.route(PROMPT, lambda: LOADS)).engine_id == "a"
    await store.close()


async def test_a_burst_routed_at_once_goes_by_the_loads_of_those_routed_before_it(make_store):
    """Lookups made at the same moment share one Redis round trip, so a burst of prompts (a batch's lines) all
    wait on the index together: each must weigh the engines as the ones routed before it left them, or the
    whole burst goes to the engine that was least loaded when it began."""
    router = PrefixRouter(await make_store("redis"), timeout_s=1.0)
    sent = {"a": 0, "b": 2}   # b busier: loads read before the lookups would send all four to a

    def loads() -> list[EngineLoad]:
        return [EngineLoad(engine, requests_waiting=n) for engine, n in sent.items()]

    async def one(i: int) -> None:
        decision = await router.route([f"burst{i}".encode()], loads)
        sent[decision.engine_id] += 1   # counted on its engine before anything else awaits, as the pool does

    await asyncio.gather(*(one(i) for i in range(4)))
    assert sent == {"a": 3, "b": 3}
