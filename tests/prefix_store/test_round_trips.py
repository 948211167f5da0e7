"""Each index operation costs exactly one Redis round trip, whatever the number of engines."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aredis
from redis.asyncio.connection import Connection

from prefix_store import ApplyResult, BlockRemoved, RedisPrefixStore
from tests.prefix_store.conftest import SHARED_REDIS_URL
from tests.prefix_store.kv_workload import KVWorkload


class CountingConnection(Connection):
    """Counts writes to the socket: a pipeline or a script is one write, then one read."""

    sends = 0

    async def send_packed_command(self, command, check_health=True):
        CountingConnection.sends += 1
        return await super().send_packed_command(command, check_health)


def counting_client() -> aredis.Redis:
    pool = aredis.ConnectionPool.from_url(SHARED_REDIS_URL, connection_class=CountingConnection)
    return aredis.Redis.from_pool(pool)  # the client owns the pool and closes it


async def test_one_round_trip_per_operation(make_store):
    store = await make_store("redis", client=counting_client())
    await store.load_scripts()
    engines = {f"e{i}": KVWorkload(seed=i) for i in range(5)}
    for engine_id, work in engines.items():
        next_seq, hashes = work.kv.snapshot()
        await store.publish_snapshot(engine_id, hashes, next_seq)

    def trips(before: int) -> int:
        return CountingConnection.sends - before

    for engine_id, work in engines.items():
        work.run(6)  # many events per step: still one round trip
        events = work.kv.take_events()
        assert len(events) > 1
        before = CountingConnection.sends
        await store.apply_events(engine_id, events)
        assert trips(before) == 1

    probe = engines["e0"].probes(1)[0]
    before = CountingConnection.sends
    answer = await store.match(probe)
    assert trips(before) == 1
    assert set(answer) == set(engines)

    for call in (lambda: store.heartbeat("e0"), lambda: store.clear_engine("e4"),
                 lambda: store.publish_snapshot("e4", [b"x"], 0)):
        before = CountingConnection.sends
        await call()
        assert trips(before) == 1


async def test_match_is_one_command_on_the_server(private_redis):
    """The server's own statistics agree: one EVALSHA per routing decision and nothing else."""
    store = RedisPrefixStore.from_url(private_redis.url, namespace="t", ttl_s=10)
    await store.load_scripts()
    for i in range(8):
        await store.publish_snapshot(f"e{i}", [b"a", b"b"], 0)
    admin = aredis.Redis.from_url(private_redis.url)
    await admin.config_resetstat()
    for _ in range(10):
        assert len(await store.match([b"a", b"b", b"c"])) == 8
    stats = await admin.info("commandstats")
    await admin.aclose()
    await store.close()
    calls = {k: v["calls"] for k, v in stats.items()}
    assert calls.pop("cmdstat_evalsha") == 10
    # What the script runs inside the server: one clock read, one engine scan, one read per engine.
    assert calls.pop("cmdstat_time") == 10
    assert calls.pop("cmdstat_zrangebyscore") == 10
    assert calls.pop("cmdstat_hmget") == 10 * 8
    # The rest came from the admin connection itself.
    assert set(calls) <= {"cmdstat_config|resetstat", "cmdstat_info"}


async def test_concurrent_matches_share_one_round_trip(make_store):
    store = await make_store("redis", client=counting_client())
    await store.load_scripts()
    # Engine e{i} holds the first i blocks of the prompt: every answer differs.
    prompt = [bytes([b]) * 32 for b in range(6)]
    for i in range(6):
        await store.publish_snapshot(f"e{i}", prompt[:i], 0)
    probes = [prompt[:n] for n in range(7)] * 6
    before = CountingConnection.sends
    answers = await asyncio.gather(*(store.match(p) for p in probes))
    assert CountingConnection.sends - before <= 2  # 42 lookups, one batch (two at worst)
    for probe, answer in zip(probes, answers):
        assert answer == {f"e{i}": min(i, len(probe)) for i in range(6)}


async def test_a_large_snapshot_uploads_in_chunks_and_swaps_in_at_once(namespace):
    store = RedisPrefixStore(counting_client(), namespace=namespace, ttl_s=10, owns_client=True,
                             snapshot_chunk=4)
    await store.load_scripts()
    await store.publish_snapshot("e", [b"old"], 0)
    hashes = [bytes([i]) for i in range(9)] + [b"\x00"]  # ten hashes, nine distinct
    before = CountingConnection.sends
    await store.publish_snapshot("e", hashes, 5)
    assert CountingConnection.sends - before == 3 + 1  # three chunks of at most 4, then the swap
    assert await store.match(hashes[:9]) == {"e": 9}
    assert await store.match([b"old"]) == {"e": 0}
    # Counts survived staging: the duplicate needs two removals.
    assert await store.apply_events("e", [BlockRemoved(5, [b"\x00"])]) is ApplyResult.APPLIED
    assert await store.match([b"\x00"]) == {"e": 1}
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    assert list(client.scan_iter(match="{" + namespace + "}:stage:*")) == []
    client.close()
    await store.close()
