"""Prefill/decode disaggregation with real processes: a prefill engine, a decode engine, a colocated
engine and a gateway on loopback, with a redis-server of their own. Greedy text through the pair
equals the colocated engine's, the decode engine never prefills it, and a request still gets the
same text when its decode engine dies after the handover, when the handoff is cut, or when its
prefill engine dies before it (the colocated engine then serves what is left). The prefill engine
takes 32 tokens a step, so the longer prompts send their blocks ahead of the first token. A gateway with the
default --local-prefill-tokens sends the short prompts whole to the decode engine, same text."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from tests.cluster import harness as h

pytestmark = pytest.mark.slow

BLOCK = 16
PREFILL_STEP = 32   # the prefill engine's --max-num-batched-tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("disagg-tiny")))


def role_args(role: str, model: str, redis_url: str, port: int, metrics_port: int) -> list[str]:
    args = h.engine_args(model, redis_url, port)
    args[args.index("--role") + 1] = role
    args[args.index("--engine-id") + 1] = f"{role}-{port}"
    # A small window: a handoff takes many round trips.
    return args + ["--kv-transfer-window", "4KiB", "--metrics-port", str(metrics_port)]


class DisaggCluster:
    def __init__(self, model: str, logs):
        self.model, self.logs = model, logs
        self.redis = h.RedisServer()
        self.ports = {"engine": h.free_port(), "prefill": h.free_port(), "decode": h.free_port()}
        self.metrics_ports = {role: h.free_port() for role in self.ports}
        self.gw_port = h.free_port()
        self.base = f"http://127.0.0.1:{self.gw_port}"
        self.nodes: dict[str, h.Node] = {}

    def start_engine(self, role: str) -> None:
        port = self.ports[role]
        args = role_args(role, self.model, self.redis.url, port, self.metrics_ports[role])
        if role == "prefill":   # prompts past 32 tokens take several chunks: their blocks go ahead over the wire
            args[args.index("--max-num-batched-tokens") + 1] = str(PREFILL_STEP)
        self.nodes[role] = h.Node(args, str(self.logs / f"{role}-{port}.log")).start()

    def start_gateway(self) -> None:
        # Every prompt through the prefill engine: the pair is what these tests check.
        self.nodes["gateway"] = h.Node(h.gateway_args(self.model, self.redis.url, self.gw_port,
                                                      "--local-prefill-tokens", "0"),
                                       str(self.logs / "gateway.log")).start()

    def wait_engines(self, n: int, timeout: float = 180) -> None:
        h.wait_until(lambda: h.metric(self.base, "matinee_engines") == n, timeout,
                     f"{n} engines behind the gateway", list(self.nodes.values()))

    def restart(self, role: str) -> None:
        self.nodes[role].kill()
        self.start_engine(role)
        self.wait_engines(3)

    def body(self, prompt, max_tokens: int) -> dict:
        return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    def complete(self, prompt, max_tokens: int = 10) -> str:
        status, body = h.http_json("POST", self.base + "/v1/completions", self.body(prompt, max_tokens))
        assert status == 200, body
        return body["choices"][0]["text"]

    def stats(self, role: str):
        return engine_stats(self.redis.url, role)

    def stop(self) -> None:
        for node in self.nodes.values():
            node.kill()
        self.redis.stop()


def engine_stats(redis_url: str, role: str):
    """The EngineStats of the one engine registered with this role."""
    from actors.messages.front_end import GetStats
    return ask_engine(redis_url, role, GetStats())


def ask_engine(redis_url: str, role: str, msg):
    """The one engine registered with this role's answer to `msg`."""
    from actors.nodes.engine_node import registry_name
    from runtime import ActorSystem
    from runtime.redis_registry import RedisRegistry

    async def probe():
        registry = RedisRegistry(redis_url, secret=h.SECRET)
        system = ActorSystem("probe", secret=h.SECRET)
        await system.start()
        try:
            prefix = registry_name(role, "")
            entries = {k: v for k, v in (await registry.entries(prefix)).items() if "/" not in k[len(prefix):]}
            assert len(entries) == 1, entries
            node, path = next(iter(entries.values()))
            return await system.ref_for(node, path).ask(msg, timeout=5)
        finally:
            await system.shutdown()
            await registry.close()

    return asyncio.run(probe())


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 360) for _ in range(n)]


PROMPTS_SEED = 17


def _prompts() -> list[list[int]]:
    rng = random.Random(PROMPTS_SEED)
    system = _prompt(rng, 3 * BLOCK)
    return [_prompt(rng, n) for n in (2, 15, 16, 33, 90)] + [system + _prompt(rng, k) for k in (3, 9, 20)]


LONG = 100   # tokens of the streams an engine dies under


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    c = DisaggCluster(model, tmp_path_factory.mktemp("disagg-logs"))
    try:
        c.redis.start()
        c.start_engine("engine")
        c.start_gateway()
        c.wait_engines(1)
        # The colocated engine's greedy text, while it is the only engine.
        c.expected = [c.complete(p) for p in _prompts()]
        rng = random.Random(5)
        c.long_prompts = [_prompt(rng, 40 + 17 * i) for i in range(3)]
        c.long_expected = [c.complete(p, LONG) for p in c.long_prompts]
        c.start_engine("prefill")
        c.start_engine("decode")
        c.wait_engines(3)
        yield c
    finally:
        c.stop()


def test_greedy_text_through_a_prefill_and_a_decode_engine_equals_the_colocated_one(cluster):
    before = cluster.stats("decode")
    prompts = _prompts()
    assert [cluster.complete(p) for p in prompts] == cluster.expected   # one by one: prefix hits
    out: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, cluster.complete(prompts[i])))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [out[i] for i in range(len(prompts))] == cluster.expected   # all at once
    d, p, e = cluster.stats("decode"), cluster.stats("prefill"), cluster.stats("engine")
    n = 2 * len(prompts)
    assert d.kv_handoffs_received - before.kv_handoffs_received == n
    assert d.prefill_steps == before.prefill_steps and d.prefill_tokens == before.prefill_tokens
    assert p.kv_handoffs_sent >= n and p.kv_transfer_bytes > 0 and p.prefix_cache_hit_tokens >= 2 * 3 * BLOCK
    assert p.kv_transfer_blocks_ahead <= p.kv_transfer_blocks
    assert e.prompt_tokens == sum(map(len, prompts)) + sum(map(len, cluster.long_prompts))   # only the reference
    assert h.metric(cluster.base, "matinee_kv_handoffs_total") >= n
    engine_http = f"http://127.0.0.1:{cluster.metrics_ports['prefill']}"
    h.wait_until(lambda: h.metric(engine_http, "matinee_kv_transfer_bytes_total") >= p.kv_transfer_bytes, 10,
                 "the prefill engine's /metrics")
    assert h.metric(f"http://127.0.0.1:{cluster.metrics_ports['decode']}", "matinee_prefill_steps_total") == \
        d.prefill_steps


def test_each_engine_tells_the_gateway_its_kv_layout(cluster):
    from actors.messages.front_end import GetEngineInfo
    layouts = {role: ask_engine(cluster.redis.url, role, GetEngineInfo()).kv_layout for role in ("prefill", "decode")}
    assert layouts["prefill"] == layouts["decode"] and "float32[16x" in layouts["decode"]   # --dtype float32


def test_a_gateway_with_the_default_prefills_short_prompts_on_the_decode_engine(cluster):
    from gateway.engine_pool import PoolConfig
    limit = PoolConfig().local_prefill_tokens
    port = h.free_port()
    gateway = h.Node(h.gateway_args(cluster.model, cluster.redis.url, port), str(cluster.logs / "gateway-local.log"))
    cluster.nodes["gateway-local"] = gateway.start()
    base = f"http://127.0.0.1:{port}"
    h.wait_until(lambda: h.metric(base, "matinee_engines") == 3, 60, "3 engines behind the second gateway", [gateway])
    prompts = _prompts()
    before = cluster.stats("decode")
    texts = []
    for p in prompts:
        status, body = h.http_json("POST", base + "/v1/completions", cluster.body(p, 10))
        assert status == 200, body
        texts.append(body["choices"][0]["text"])
    assert texts == cluster.expected
    d = cluster.stats("decode")
    short = [p for p in prompts if len(p) <= limit]
    assert short and len(short) < len(prompts)
    assert d.kv_handoffs_received - before.kv_handoffs_received == len(prompts) - len(short)
    assert d.prefill_steps - before.prefill_steps >= 1   # the short ones were prefilled there
    gateway.kill()
    del cluster.nodes["gateway-local"]


def _stream_and(cluster, i: int, action, at: int) -> None:
    done: list[int] = []

    def on_event(n: int) -> None:
        if n >= at and not done:
            done.append(n)
            action()

    text, errors = h.stream_text(cluster.base + "/v1/completions", cluster.body(cluster.long_prompts[i], LONG),
                                 on_event=on_event)
    assert done, "the action never ran"
    assert not errors and text == cluster.long_expected[i]


def test_a_decode_engine_dying_after_the_handover_migrates_its_stream(cluster):
    before = h.metric(cluster.base, "matinee_request_migrations_total")
    _stream_and(cluster, 0, cluster.nodes["decode"].kill, at=10)
    assert h.metric(cluster.base, "matinee_request_migrations_total") > before
    cluster.restart("decode")


def test_a_handoff_cut_by_the_decode_engine_dying_recomputes_elsewhere(cluster):
    failed = cluster.stats("prefill").kv_handoffs_failed
    decode = cluster.nodes["decode"].proc
    decode.send_signal(h.signal.SIGSTOP)   # the handoff starts and stalls: offer or chunks unanswered
    try:
        # The first token comes from the prefill engine; then the decode engine dies mid-handoff.
        _stream_and(cluster, 1, lambda: (time.sleep(0.3), cluster.nodes["decode"].kill()), at=1)
    finally:
        if decode.poll() is None:
            decode.send_signal(h.signal.SIGCONT)
    assert cluster.stats("prefill").kv_handoffs_failed == failed + 1   # the prefill engine saw it cut
    cluster.restart("decode")


def test_a_prefill_engine_dying_mid_request_is_recomputed_elsewhere(cluster):
    before = h.metric(cluster.base, "matinee_request_migrations_total")
    prefill = cluster.nodes["prefill"].proc
    prefill.send_signal(h.signal.SIGSTOP)   # the request reaches it and waits there
    result: dict = {}

    def run() -> None:
        result["out"] = h.stream_text(cluster.base + "/v1/completions", cluster.body(cluster.long_prompts[2], LONG))

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    cluster.nodes["prefill"].kill()
    t.join(120)
    text, errors = result["out"]
    assert not errors and text == cluster.long_expected[2]
    assert h.metric(cluster.base, "matinee_request_migrations_total") > before
