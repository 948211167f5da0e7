"""The engine-side publisher keeps the index equal to the KV manager's cache, through gaps,
restarts and a Redis outage, without ever raising into the engine."""

from __future__ import annotations

import asyncio
import contextlib

from prefix_store import InMemoryPrefixStore, IndexPublisher, RedisPrefixStore
from tests.prefix_store.conftest import FakeClock
from tests.prefix_store.kv_workload import KVWorkload


async def assert_index_matches(store, engine_id, work: KVWorkload):
    for probe in work.probes(6):
        assert (await store.match(probe)).get(engine_id) == work.truth(probe)


async def test_published_steps_keep_the_index_equal_to_the_cache(store):
    work = KVWorkload(seed=5)
    publisher = IndexPublisher(store, "e", work.events)
    await publisher.start()
    assert await store.live_engines() == ["e"]
    for _ in range(5):
        work.run(3)
        await publisher.publish()
        await assert_index_matches(store, "e", work)
    assert publisher.snapshots == 1  # only the initial one: the stream had no gap


async def test_dropped_events_are_repaired_by_a_snapshot(store):
    work = KVWorkload(seed=6, max_events=4)  # the KV manager keeps few undrained events
    publisher = IndexPublisher(store, "e", work.events)
    await publisher.start()
    work.run(2)
    await publisher.publish()
    work.run(10)  # far more than 4 events: the oldest are dropped, leaving a gap
    await publisher.publish()
    assert publisher.snapshots == 2
    await assert_index_matches(store, "e", work)


async def test_a_restarted_engine_leaves_no_stale_entries(store):
    old = KVWorkload(seed=7)
    publisher = IndexPublisher(store, "e", old.events)
    await publisher.start()
    old.run(4)
    await publisher.publish()
    held = [p for p in old.probes(6) if old.truth(p) > 0]
    assert held and all([(await store.match(p))["e"] > 0 for p in held])

    fresh = KVWorkload(seed=7)  # same engine id, empty cache, sequence numbers from 0 again
    await IndexPublisher(store, "e", fresh.events).start()
    assert all([(await store.match(p))["e"] == 0 for p in held])


async def test_a_redis_outage_never_raises_and_resyncs_after(private_redis):
    store = RedisPrefixStore.from_url(private_redis.url, namespace="t", ttl_s=10)
    work, clock = KVWorkload(seed=8), FakeClock()
    publisher = IndexPublisher(store, "e", work.events, timeout_s=0.3, clock=clock)
    await publisher.start()
    work.run(3)
    await publisher.publish()

    private_redis.stop()
    work.run(3)
    await publisher.publish()  # the drained events are lost; no exception
    private_redis.start()  # back, and empty
    work.run(1)
    await publisher.publish()  # too soon after the failure: no retry yet
    assert publisher.snapshots == 1
    clock.now += publisher.heartbeat_s
    await publisher.publish()
    assert publisher.snapshots == 2
    await assert_index_matches(store, "e", work)
    await store.close()


async def test_the_run_loop_publishes_when_notified_and_heartbeats_when_idle():
    store = InMemoryPrefixStore(ttl_s=0.6)
    work = KVWorkload(seed=9)
    assert abs(IndexPublisher(store, "e", work.events).heartbeat_s - 0.2) < 1e-9  # three per TTL
    publisher = IndexPublisher(store, "e", work.events, heartbeat_s=0.05)
    await publisher.start()
    task = asyncio.create_task(publisher.run())
    try:
        work.run(3)
        publisher.notify()
        for _ in range(3):
            await asyncio.sleep(0)
        await assert_index_matches(store, "e", work)
        await asyncio.sleep(0.7)  # idle past the TTL: heartbeats keep the engine live
        assert await store.live_engines() == ["e"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await publisher.stop()
    assert await store.live_engines() == []


async def test_an_engine_that_lapsed_is_restored_by_its_next_beat():
    clock = FakeClock()
    store = InMemoryPrefixStore(ttl_s=1.0, clock=clock)
    work = KVWorkload(seed=10)
    publisher = IndexPublisher(store, "e", work.events, clock=clock)
    await publisher.start()
    work.run(3)
    await publisher.publish()
    clock.now += 2.0  # the engine stalled past its TTL: the index dropped it
    assert await store.live_engines() == []
    await publisher.publish()  # no events: a heartbeat, refused, so a snapshot follows
    assert publisher.snapshots == 2
    await assert_index_matches(store, "e", work)


async def test_published_through_the_kv_actor_the_index_follows_the_cache_and_its_gaps(store):
    """The engine's publisher reads the KV actor only through its messages (drain, snapshot): the
    index still equals the cache, and a gap in the stream is repaired by a snapshot."""
    from actors.kv.kv_actor import KVActorEvents, KVManagerActor
    from runtime import ActorSystem

    work = KVWorkload(seed=11, max_events=4)
    actor = KVManagerActor(work.kv.config)
    actor.kv = work.kv  # the workload drives the manager the actor owns, on the same loop
    system = ActorSystem("publisher-test")
    await system.start()
    try:
        publisher = IndexPublisher(store, "e", KVActorEvents(await system.spawn(actor, name="kv")))
        await publisher.start()
        work.run(1)
        await publisher.publish()
        await assert_index_matches(store, "e", work)
        work.run(10)  # more events than the log keeps: a gap
        await publisher.publish()
        assert publisher.snapshots == 2
        await assert_index_matches(store, "e", work)
    finally:
        await system.shutdown()
