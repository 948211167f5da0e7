"""Both prefix stores against real KV manager event streams, and against each other."""

from __future__ import annotations

import asyncio

import pytest
import redis

from prefix_store import AllBlocksCleared, ApplyResult, BlockRemoved, BlockStored, InMemoryPrefixStore
from tests.prefix_store.conftest import SHARED_REDIS_URL, FakeClock
from tests.prefix_store.kv_workload import KVWorkload


def stored(seq: int, *hashes: bytes) -> BlockStored:
    return BlockStored(seq, list(hashes), None, [0] * 4 * len(hashes), 4)


def removed(seq: int, *hashes: bytes) -> BlockRemoved:
    return BlockRemoved(seq, list(hashes))


async def test_event_stream_gives_the_kv_managers_answers_in_both_stores(make_store):
    memory, red = await make_store("memory"), await make_store("redis")
    engines = {"e0": KVWorkload(seed=1), "e1": KVWorkload(seed=2)}
    for engine_id, work in engines.items():
        next_seq, hashes = work.kv.snapshot()
        for s in (memory, red):
            await s.publish_snapshot(engine_id, hashes, next_seq)
    kinds, answers = set(), set()
    for step in range(12):
        for engine_id, work in engines.items():
            work.run(3)
            if step == 7 and engine_id == "e1":
                work.kv.reset_prefix_cache()
                work.run(1)
            events = work.kv.take_events()
            kinds |= {type(e) for e in events}
            for s in (memory, red):
                assert await s.apply_events(engine_id, events) is ApplyResult.APPLIED
        for probe in engines["e0"].probes(4) + engines["e1"].probes(4):
            want = {engine_id: work.truth(probe) for engine_id, work in engines.items()}
            assert await memory.match(probe) == want
            assert await red.match(probe) == want
            answers |= {(n > 0, n == len(probe)) for n in want.values()}
    # The stream exercised every event kind, and hits of several lengths were checked.
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
    assert answers == {(False, False), (True, False), (True, True)}  # misses, partial and full hits


async def test_match_answers_every_live_engine_with_leading_blocks_only(store):
    await store.publish_snapshot("a", [b"h1", b"h2", b"h4"], 0)
    await store.publish_snapshot("b", [b"h1"], 0)
    await store.publish_snapshot("c", [], 0)
    # "a" holds h4 but not h3: only the leading run counts.
    assert await store.match([b"h1", b"h2", b"h3", b"h4"]) == {"a": 2, "b": 1, "c": 0}
    assert await store.match([]) == {"a": 0, "b": 0, "c": 0}
    assert await store.live_engines() == ["a", "b", "c"]


async def test_a_gap_in_the_sequence_asks_for_a_snapshot_and_applies_nothing(store):
    await store.publish_snapshot("e", [], 0)
    assert await store.apply_events("e", [stored(0, b"x"), stored(1, b"y")]) is ApplyResult.APPLIED
    # seq 2 was lost: the batch must not be applied, even partly.
    assert await store.apply_events("e", [stored(3, b"z"), removed(4, b"x")]) is ApplyResult.NEED_SNAPSHOT
    assert await store.match([b"x", b"y"]) == {"e": 2}
    # The snapshot replaces everything; the stream resumes at its next_seq.
    await store.publish_snapshot("e", [b"z"], 5)
    assert await store.match([b"x"]) == {"e": 0}
    assert await store.apply_events("e", [stored(5, b"w")]) is ApplyResult.APPLIED
    assert await store.match([b"z"]) == {"e": 1}
    assert await store.match([b"w"]) == {"e": 1}
    # A gap inside one batch is a gap too.
    assert await store.apply_events("e", [stored(6, b"v"), stored(8, b"u")]) is ApplyResult.NEED_SNAPSHOT
    assert await store.match([b"v"]) == {"e": 0}


async def test_events_already_applied_are_skipped_when_resent(store):
    await store.publish_snapshot("e", [], 0)
    batch = [stored(0, b"x"), stored(1, b"y")]
    assert await store.apply_events("e", batch) is ApplyResult.APPLIED
    # The reply was lost and the engine resends, with the next event appended.
    assert await store.apply_events("e", batch + [removed(2, b"y")]) is ApplyResult.APPLIED
    assert await store.match([b"x", b"y"]) == {"e": 1}
    # Events older than a snapshot are already in it.
    await store.publish_snapshot("e", [b"x", b"y"], 10)
    assert await store.apply_events("e", [removed(9, b"x")]) is ApplyResult.APPLIED
    assert await store.match([b"x", b"y"]) == {"e": 2}


async def test_an_unknown_engine_must_start_with_a_snapshot(store):
    assert await store.apply_events("new", [stored(0, b"x")]) is ApplyResult.NEED_SNAPSHOT
    assert await store.heartbeat("new") is False
    assert await store.match([b"x"]) == {}


async def test_duplicate_hashes_are_refcounted(store):
    # Two blocks with the same content: removing one leaves the other matchable.
    await store.publish_snapshot("e", [b"x", b"x"], 0)
    assert await store.apply_events("e", [removed(0, b"x")]) is ApplyResult.APPLIED
    assert await store.match([b"x"]) == {"e": 1}
    events = [removed(1, b"x"), removed(2, b"never-stored")]
    assert await store.apply_events("e", events) is ApplyResult.APPLIED
    assert await store.match([b"x"]) == {"e": 0}


async def test_a_cleared_event_drops_everything_the_engine_held(store):
    await store.publish_snapshot("e", [b"x"], 0)
    events = [stored(0, b"y"), AllBlocksCleared(1), stored(2, b"z")]
    assert await store.apply_events("e", events) is ApplyResult.APPLIED
    assert await store.match([b"x"]) == {"e": 0}
    assert await store.match([b"z"]) == {"e": 1}


async def test_restart_clears_the_engine(store):
    await store.publish_snapshot("e", [b"x"], 0)
    await store.publish_snapshot("other", [b"x"], 0)
    await store.clear_engine("e")
    assert await store.match([b"x"]) == {"other": 1}
    assert await store.apply_events("e", [stored(0, b"y")]) is ApplyResult.NEED_SNAPSHOT
    await store.clear_engine("never-seen")  # harmless


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_dead_engines_entries_expire(make_store, namespace, kind):
    # Redis expires on its own clock, so its twin runs in real time; the in-memory one on a
    # fake clock (same steps, no sleeping).
    if kind == "memory":
        clock = FakeClock()
        store = InMemoryPrefixStore(ttl_s=0.6, clock=clock)

        async def advance(dt):
            clock.now += dt
    else:
        store = await make_store(kind, ttl_s=0.6)
        advance = asyncio.sleep
    await store.publish_snapshot("alive", [b"x"], 0)
    await store.publish_snapshot("dead", [b"x"], 0)
    assert await store.match([b"x"]) == {"alive": 1, "dead": 1}
    for _ in range(8):  # only "alive" keeps beating
        await advance(0.1)
        assert await store.heartbeat("alive") is True
    assert await store.match([b"x"]) == {"alive": 1}
    assert await store.live_engines() == ["alive"]
    assert await store.heartbeat("dead") is False
    assert await store.apply_events("dead", [stored(0, b"y")]) is ApplyResult.NEED_SNAPSHOT
    # A snapshot brings it back.
    await store.publish_snapshot("dead", [b"y"], 1)
    assert await store.match([b"y"]) == {"alive": 0, "dead": 1}
    await advance(0.7)  # nobody beats now
    assert await store.match([b"y"]) == {}
    if kind == "redis":  # and Redis has freed every per-engine key by itself
        client = redis.Redis.from_url(SHARED_REDIS_URL)
        leftover = [k for k in client.scan_iter(match="{" + namespace + "}*") if b":engines" not in k]
        client.close()
        assert leftover == []

