"""Fixtures for the prefix index: both stores over real Redis, and a private redis-server.

Each test gets its own key namespace on the shared Redis and deletes its keys afterwards;
tests that stop or stall Redis start their own server on a free port.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis
import redis.asyncio as aredis

from prefix_store import InMemoryPrefixStore, RedisPrefixStore, make_client

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"
TTL_S = 10.0


@pytest.fixture
def namespace():
    ns = f"test:prefix:{uuid.uuid4().hex}"
    yield ns
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    keys = list(client.scan_iter(match="{" + ns + "}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
async def make_store(namespace):
    """Build a store of either kind; Redis ones share the test's namespace and close after it."""
    opened = []

    async def make(kind: str, ttl_s: float = TTL_S, client: aredis.Redis | None = None):
        if kind == "memory":
            return InMemoryPrefixStore(ttl_s=ttl_s)
        store = RedisPrefixStore(client or make_client(SHARED_REDIS_URL), namespace=namespace,
                                 ttl_s=ttl_s, owns_client=True)
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


@pytest.fixture(params=["memory", "redis"])
async def store(request, make_store):
    return await make_store(request.param)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateRedis:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--enable-debug-command", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 5
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("private redis-server did not start")
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=5)


@pytest.fixture
def private_redis():
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed")
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()
