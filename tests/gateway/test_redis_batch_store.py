"""The cluster's batch store over the shared real Redis, each test in a namespace of its own, deleted
after it: files and batches round trip, a lease lets one gateway run a batch and passes on once it
lapses, and a gateway that lost its lease records nothing more."""
import asyncio
import time
import uuid

import pytest
import redis

from gateway.batch_store import LeaseLost, now
from gateway.redis_batch_store import RedisBatchStore

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def stores():
    ns = f"test:batch:{uuid.uuid4().hex}"
    opened = []

    def make(lease_s: float = 30.0) -> RedisBatchStore:
        store = RedisBatchStore.from_url(REDIS_URL, ns, lease_s)
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=ns + ":*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def _record(batch_id: str, status: str = "in_progress") -> dict:
    return {"batch": {"id": batch_id, "status": status}, "owner": ""}


async def test_files_round_trip_and_expire_with_their_object(stores):
    a, b = stores(), stores()   # two gateways
    await a.write_data("file-1", b"line\n")
    await a.save_file({"id": "file-1", "bytes": 5, "expires_at": now() + 1})
    await a.write_data("file-2", b"kept\n")
    await a.save_file({"id": "file-2", "bytes": 5, "expires_at": now() + 3600})
    assert (await b.load_file("file-1"))["bytes"] == 5 and await b.read_data("file-1") == b"line\n"
    assert sorted(await b.file_ids()) == ["file-1", "file-2"]
    await asyncio.sleep(2.1)   # whole seconds, as `expires_at`
    assert await b.load_file("file-1") is None and await b.file_ids() == ["file-2"]
    with pytest.raises(FileNotFoundError):
        await b.read_data("file-1")
    await b.delete_file("file-2")
    assert await a.file_ids() == [] and await a.load_file("file-2") is None


async def test_one_gateway_holds_a_batch_until_its_lease_lapses(stores):
    a, b = stores(lease_s=0.5), stores(lease_s=0.5)
    await a.save_batch(_record("batch_1"))
    assert await b.batch_ids() == ["batch_1"]
    lease_a = await a.claim("batch_1")
    assert lease_a is not None and await b.claim("batch_1") is None
    for _ in range(4):   # renewed, it outlives its own length
        await asyncio.sleep(0.25)
        assert await a.renew("batch_1", lease_a)
    assert await b.claim("batch_1") is None
    await asyncio.sleep(0.7)   # a stopped renewing (as if killed): the lease lapses
    lease_b = await b.claim("batch_1")
    assert lease_b is not None and not await a.renew("batch_1", lease_a)
    with pytest.raises(LeaseLost):
        await a.results("batch_1").append({"index": 0, "ok": True, "line": {}}, lease_a)
    with pytest.raises(LeaseLost):
        await a.save_batch(_record("batch_1", "completed"), lease_a)
    assert (await b.load_batch("batch_1"))["batch"]["status"] == "in_progress"
    await a.release("batch_1", lease_a)   # not a's to give back: b keeps it
    assert await a.claim("batch_1") is None
    await b.release("batch_1", lease_b)
    assert await a.claim("batch_1") is not None


async def test_a_line_is_recorded_once(stores):
    a = stores()
    await a.save_batch(_record("batch_2"))
    lease = await a.claim("batch_2")
    log = a.results("batch_2")
    assert await log.append({"index": 3, "ok": True, "line": {"custom_id": "x"}}, lease)
    assert await log.append({"index": 5, "ok": False, "line": {"custom_id": "y"}}, lease)
    assert not await log.append({"index": 3, "ok": True, "line": {"custom_id": "x-again"}}, lease)
    assert await log.counts() == (1, 1)
    records = sorted(await stores().results("batch_2").records(), key=lambda r: r["index"])
    assert [(r["index"], r["line"]["custom_id"]) for r in records] == [(3, "x"), (5, "y")]
    await a.save_batch(_record("batch_2", "completed"), lease)
    assert (await a.load_batch("batch_2"))["batch"]["status"] == "completed"


async def test_a_cancel_asked_anywhere_is_seen_everywhere(stores):
    a, b = stores(), stores()
    await a.save_batch(_record("batch_3"))
    assert await b.cancel_requested("batch_3") is None
    before = int(time.time())
    await b.request_cancel("batch_3")
    assert await a.cancel_requested("batch_3") >= before
    await a.delete_batch("batch_3")
    assert await b.batch_ids() == [] and await b.cancel_requested("batch_3") is None
