"""Registries: the in-memory one, and Redis entries with a TTL that outlive a node only briefly."""
import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from runtime import Actor, ActorSystem, InMemoryRegistry
from runtime.redis_registry import RedisRegistry
from tests.runtime.nodes import SECRET, start_node
from tests.runtime.wire_messages import RtEcho


class Echo(Actor):
    async def receive(self, msg):
        return RtEcho(msg.value + 1)


@pytest.fixture
async def prefix():
    p = f"test:runtime:{uuid.uuid4().hex}:"
    yield p
    r = aioredis.Redis.from_url("redis://127.0.0.1:6379/0")
    keys = [k async for k in r.scan_iter(match=p + "*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


async def test_in_memory_registry_shared_by_two_systems():
    reg = InMemoryRegistry()
    a = ActorSystem("a", listen=0, secret=SECRET, registry=reg)
    b = ActorSystem("b", secret=SECRET, registry=reg)
    await a.start()
    await b.start()
    try:
        ref = await a.spawn(Echo(), name="echo")
        await a.publish("svc/echo", ref)
        assert await a.resolve("svc/echo") == ref   # local entries resolve to the local ref
        remote = await b.resolve("svc/echo")
        assert remote.node == a.address and remote.path == "echo"
        assert await remote.ask(RtEcho(1)) == RtEcho(2)
        assert await reg.entries("svc/") == {"svc/echo": (a.address, "echo")}
        assert await b.resolve("missing") is None
    finally:
        await b.shutdown()
        await a.shutdown()
    assert await reg.lookup("svc/echo") is None   # shutdown unpublished it


async def test_redis_registry_roundtrip_and_heartbeat(prefix):
    reg = RedisRegistry(secret=SECRET, prefix=prefix, ttl_s=0.6)
    try:
        await reg.register("engine/0", "127.0.0.1:5000", "scheduler")
        await reg.register("engine/1", "127.0.0.1:5001", "scheduler")
        await reg.register("gateway/0", "~gw", "front")
        assert await reg.lookup("engine/0") == ("127.0.0.1:5000", "scheduler")
        assert set(await reg.entries("engine/")) == {"engine/0", "engine/1"}
        await asyncio.sleep(1.3)   # two TTLs: the heartbeat keeps them alive
        assert await reg.lookup("engine/1") == ("127.0.0.1:5001", "scheduler")
        await reg.unregister("engine/1")
        assert await reg.lookup("engine/1") is None
    finally:
        await reg.close()
    with pytest.raises(ValueError):
        RedisRegistry(secret=SECRET, prefix=prefix, ttl_s=1, heartbeat_s=2)


async def test_redis_entry_of_a_killed_node_expires(prefix):
    node = await start_node("--redis-prefix", prefix, "--ttl", "0.5", "--name", "doomed")
    reg = RedisRegistry(secret=SECRET, prefix=prefix, ttl_s=5)
    client = ActorSystem("client", secret=SECRET, registry=reg)
    await client.start()
    try:
        echo = await client.resolve("doomed/echo")
        assert echo is not None and echo.node == node.address
        assert await echo.ask(RtEcho(10)) == RtEcho(11)
        node.kill()
        await node.proc.wait()
        for _ in range(40):
            if await reg.lookup("doomed/echo") is None:
                break
            await asyncio.sleep(0.05)
        assert await client.resolve("doomed/echo") is None
    finally:
        await client.shutdown()
        await node.stop()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _start_redis(port: int):
    proc = await asyncio.create_subprocess_exec(
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        stdout=asyncio.subprocess.DEVNULL)
    for _ in range(100):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return proc
        except OSError:
            await asyncio.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


async def test_heartbeat_survives_a_redis_restart():
    port = _free_port()
    redis_proc = await _start_redis(port)
    reg = RedisRegistry(f"redis://127.0.0.1:{port}/0", secret=SECRET, prefix="t:", ttl_s=0.6,
                        socket_timeout_s=0.5, connect_timeout_s=0.5, retries=1)
    try:
        await reg.register("svc", "127.0.0.1:1", "a")
        redis_proc.kill()
        await redis_proc.wait()
        await asyncio.sleep(0.5)   # heartbeats fail meanwhile: logged, not fatal
        redis_proc = await _start_redis(port)   # empty: the entry is gone until the next beat
        for _ in range(40):
            if await reg.lookup("svc") is not None:
                break
            await asyncio.sleep(0.05)
        assert await reg.lookup("svc") == ("127.0.0.1:1", "a")
    finally:
        await reg.close()
        redis_proc.kill()
        await redis_proc.wait()


async def test_redis_registry_returns_only_entries_signed_with_the_cluster_secret(prefix):
    reg = RedisRegistry(secret=SECRET, prefix=prefix)
    other = RedisRegistry(secret="another-secret", prefix=prefix)
    raw = aioredis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        await reg.register("engines/real", "127.0.0.1:5000", "front")
        await other.register("engines/other-secret", "127.0.0.1:6666", "front")
        await raw.set(prefix + "engines/unsigned", b'["127.0.0.1:6666","front"]')
        await raw.set(prefix + "engines/garbage", b"not json")
        # A genuine entry copied under another name: the MAC covers the name too.
        await raw.set(prefix + "engines/moved", await raw.get(prefix + "engines/real"))
        assert await reg.entries("engines/") == {"engines/real": ("127.0.0.1:5000", "front")}
        for name in ("engines/other-secret", "engines/unsigned", "engines/garbage", "engines/moved"):
            assert await reg.lookup(name) is None
        assert await reg.lookup("engines/real") == ("127.0.0.1:5000", "front")
        assert await other.entries("engines/") == {"engines/other-secret": ("127.0.0.1:6666", "front")}
    finally:
        await other.close()
        await reg.close()
        await raw.aclose()
    with pytest.raises(ValueError):
        RedisRegistry(secret="", prefix=prefix)
