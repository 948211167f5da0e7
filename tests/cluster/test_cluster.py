"""Two engines and a gateway as separate processes on loopback, with a redis-server of their own:
prefix-aware routing, Redis going away, an engine killed mid-stream and restarted, and a node
without the cluster secret. The engines run --batch-invariant, the setting under which a stream moved
off a killed engine is promised the text it would have had."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from tests.cluster import harness as h

pytestmark = pytest.mark.slow

BLOCK = 16
PREFIX_BLOCKS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("cluster-tiny")))


class Cluster:
    def __init__(self, model: str, logs, *gateway_extra: str):
        self.model, self.logs, self.gateway_extra = model, logs, gateway_extra
        self.redis = h.RedisServer()
        self.engine_ports = [h.free_port(), h.free_port()]
        self.gw_port = h.free_port()
        self.base = f"http://127.0.0.1:{self.gw_port}"
        self.engines: dict[int, h.Node] = {}
        self.gateway: h.Node | None = None

    def start_engine(self, port: int) -> h.Node:
        node = h.Node(h.engine_args(self.model, self.redis.url, port) + ["--batch-invariant"],
                      str(self.logs / f"engine-{port}.log"))
        self.engines[port] = node.start()
        return node

    def start(self) -> None:
        self.redis.start()
        for port in self.engine_ports:
            self.start_engine(port)
        self.gateway = h.Node(h.gateway_args(self.model, self.redis.url, self.gw_port, *self.gateway_extra),
                              str(self.logs / "gateway.log")).start()
        self.wait_engines(2)

    def nodes(self):
        return [*self.engines.values(), self.gateway]

    def wait_engines(self, n: int, timeout: float = 180) -> None:
        h.wait_until(lambda: h.metric(self.base, "matinee_engines") == n, timeout,
                     f"{n} engines behind the gateway", self.nodes())

    def complete(self, prompt, max_tokens: int = 8, api_key: str | None = None, **kw) -> dict:
        status, body = h.http_json("POST", self.base + "/v1/completions",
                                   {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True, **kw}, api_key=api_key)
        assert status == 200, body
        return body

    def stop(self) -> None:
        for node in self.nodes():
            if node is not None:
                node.kill()
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    c = Cluster(model, tmp_path_factory.mktemp("cluster-logs"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 360) for _ in range(n)]


def test_shared_prefixes_land_on_the_engine_that_holds_them(cluster):
    rng = random.Random(7)
    tenants = [_prompt(rng, PREFIX_BLOCKS * BLOCK) for _ in range(4)]
    for prefix in tenants:   # each system prompt is computed once, on the engine routing picks
        cluster.complete(prefix + _prompt(rng, 5), max_tokens=2)
    time.sleep(0.5)          # engines publish their new blocks within a few tens of ms
    held = PREFIX_BLOCKS * BLOCK
    hits = total = 0
    for _ in range(6):
        for prefix in rng.sample(tenants, len(tenants)):
            usage = cluster.complete(prefix + _prompt(rng, 7), max_tokens=2)["usage"]
            total += 1
            hits += usage["prompt_tokens_details"]["cached_tokens"] >= held
    assert hits / total >= 0.9, f"{hits}/{total} requests found their prefix cached"
    cluster.tenants = tenants
    assert h.metric(cluster.base, "matinee_routing_decisions_total") >= total
    lookups = h.metric(cluster.base, "matinee_prefix_index_lookup_seconds_count")
    assert lookups >= total


def test_tenants_never_share_cached_prefixes(cluster):
    prefix = _prompt(random.Random(21), 4 * BLOCK)
    first = cluster.complete(prefix + [4], api_key="tenant-a")
    time.sleep(0.3)
    again = cluster.complete(prefix + [5], api_key="tenant-a")
    other = cluster.complete(prefix + [6], api_key="tenant-b")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * BLOCK
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["text"] and other["choices"][0]["text"]


def test_a_node_with_the_wrong_secret_cannot_join(cluster):
    from actors.messages.front_end import EngineInfo
    from actors.messages.front_end import GetStats
    from runtime import Actor, ActorDead, ActorSystem
    from runtime.redis_registry import RedisRegistry

    class FakeFront(Actor):
        async def receive(self, msg):
            return EngineInfo("intruder", 1024, BLOCK, "x")

    async def intrude() -> None:
        # An outsider cannot talk to an engine...
        outsider = ActorSystem("outsider", secret="not-the-secret")
        await outsider.start()
        port = cluster.engine_ports[0]
        registry = RedisRegistry(cluster.redis.url, secret=h.SECRET)
        node, path = (await registry.entries("engines/"))[f"engines/engine-{port}"]
        await registry.close()
        with pytest.raises((ActorDead, ConnectionError)):
            await outsider.ref_for(node, path).ask(GetStats(), timeout=5)
        # ...nor get a gateway to route to a node it announces in the registry.
        fake = ActorSystem("intruder", listen=("127.0.0.1", 0), secret="not-the-secret",
                           registry=RedisRegistry(cluster.redis.url, secret="not-the-secret"))
        await fake.start()
        ref = await fake.spawn(FakeFront(), name="front-intruder")
        await fake.publish("engines/intruder", ref)
        await asyncio.sleep(2.0)   # several discovery rounds
        try:
            assert h.metric(cluster.base, "matinee_engines") == 2
            assert cluster.complete([5, 6, 7, 8], max_tokens=3)["choices"][0]["finish_reason"] == "length"
        finally:
            await fake.shutdown()
            await outsider.shutdown()

    asyncio.run(intrude())


def test_requests_succeed_while_redis_is_down(cluster):
    rng = random.Random(11)
    prefix = _prompt(rng, 4 * BLOCK)
    results: list = []

    def client(i: int) -> None:
        for j in range(4):
            try:
                results.append(cluster.complete(prefix + [i + 4, j + 4], max_tokens=4))
            except AssertionError as e:
                results.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    cluster.redis.stop()
    for t in threads:
        t.join(120)
    down = [cluster.complete(prefix + [9, 9, i + 4], max_tokens=4) for i in range(3)]
    cluster.redis.start()     # the same port: registry beats and index snapshots repopulate it
    failures = [r for r in results if isinstance(r, Exception)]
    assert not failures and len(results) == 12
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results + down)
    assert h.metric(cluster.base, "matinee_prefix_index_lookup_errors_total") >= 1
    cluster.wait_engines(2, timeout=30)
    # The gateway kept its engines while Redis was down; the registry itself has them again only after
    # their next heartbeats, and the tests after this one read it.
    h.wait_until(lambda: len(h.engine_loads(cluster.redis.url)) == 2, 30, "2 engines registered again",
                 cluster.nodes())


def test_streams_of_a_killed_engine_finish_on_the_other(cluster):
    """Eight streams, the busier engine SIGKILLed under them: each finishes on the other with the text it
    would have had alone, recomputed there beside other streams and in other chunks."""
    rng = random.Random(3)
    prompts = [_prompt(rng, 40 + 13 * i) for i in range(8)]
    body = {"model": "tiny", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    expected = [cluster.complete(p, max_tokens=120)["choices"][0]["text"] for p in prompts]
    before = h.metric(cluster.base, "matinee_request_migrations_total")
    out: dict[int, tuple] = {}
    killed: list[int] = []
    lock = threading.Lock()

    def kill_busiest(n: int) -> None:
        with lock:
            if killed or n < 10:
                return
            loads = h.engine_loads(cluster.redis.url)
            address = max(loads, key=loads.get)
            port = int(address.rsplit(":", 1)[1])
            cluster.engines[port].kill()
            killed.append(port)

    def run(i: int) -> None:
        out[i] = h.stream_text(cluster.base + "/v1/completions", {**body, "prompt": prompts[i]},
                               on_event=kill_busiest)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert killed, "no engine was killed"
    for i in range(8):
        text, errors = out[i]
        assert not errors
        assert text == expected[i]
    assert h.metric(cluster.base, "matinee_request_migrations_total") > before
    cluster.killed_port = killed[0]


def test_a_restarted_engine_serves_correct_tokens(cluster):
    port = getattr(cluster, "killed_port", None)
    if port is None:
        pytest.skip("runs after the kill test")
    # The first test's system prompts: some were cached on the killed engine, and the index
    # may still say so until the restarted engine clears its entries.
    prefixes = getattr(cluster, "tenants", None) or [_prompt(random.Random(5), PREFIX_BLOCKS * BLOCK)]
    cluster.wait_engines(1, timeout=30)
    expected = {i: cluster.complete(p + [7, 7], max_tokens=6)["choices"][0]["text"]
                for i, p in enumerate(prefixes)}
    cluster.start_engine(port)
    cluster.wait_engines(2)
    for _ in range(2):
        for i, p in enumerate(prefixes):
            assert cluster.complete(p + [7, 7], max_tokens=6)["choices"][0]["text"] == expected[i]


def test_a_terminated_engine_drains_its_streams_then_exits(cluster):
    rng = random.Random(9)
    prompt = _prompt(rng, 40)
    body = {"model": "tiny", "max_tokens": 80, "temperature": 0, "ignore_eos": True, "prompt": prompt}
    expected = cluster.complete(prompt, max_tokens=80)["choices"][0]["text"]
    stopped: list[int] = []

    def terminate_busiest(n: int) -> None:
        if stopped or n < 5:
            return
        loads = h.engine_loads(cluster.redis.url)
        port = int(max(loads, key=loads.get).rsplit(":", 1)[1])
        cluster.engines[port].proc.send_signal(h.signal.SIGTERM)
        stopped.append(port)

    text, errors = h.stream_text(cluster.base + "/v1/completions", body, on_event=terminate_busiest)
    assert stopped and not errors and text == expected
    assert cluster.engines[stopped[0]].proc.wait(30) == 0
    cluster.wait_engines(1, timeout=30)
    assert cluster.complete(prompt, max_tokens=80)["choices"][0]["text"] == expected
