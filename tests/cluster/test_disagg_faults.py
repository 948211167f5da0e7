"""Handoffs that go wrong between real processes (a prefill engine, a decode engine with a pool of
twelve blocks reached through a relay, two gateways, a redis-server of their own): the relay cuts
the connection halfway through the KV frame, or the prefill engine dies halfway through it, or
the decode engine has no room and refuses; each request still ends with the colocated engine's
greedy text, and the decode engine gets every reserved block back. Last, a prefill engine of a few
tokens a step has the cut land while its blocks go ahead of the first token."""
from __future__ import annotations

import random
import threading
import time

import pytest

from tests.cluster import harness as h
from tests.cluster.test_disagg import engine_stats, role_args
from tests.cluster.test_wire_relay import RelayThread
from tests.runtime.relay import TO_SERVER, Cut

pytestmark = pytest.mark.slow

BLOCK = 16
DECODE_BLOCKS = 12      # room for one of the requests below while it decodes, not two
PROMPT, OUTPUT = 100, 60   # 7 blocks handed over; 10 once decoded
KV_FRAME = BLOCK * 768      # a block of the tiny model's KV (3 layers x K,V x 2 heads x 16 x 4 bytes)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("disagg-faults-tiny")))


class KVFrameCutter:
    """Armed, it lets half of the next frame towards the decode engine that is large enough to be
    KV blocks through, runs `then` (a kill, say) and cuts the connection; unarmed it forwards."""

    def __init__(self):
        self.armed, self.then, self.cuts = False, None, 0

    def __call__(self, direction: str, index: int, chunk: bytes) -> list[bytes]:
        if not self.armed or direction != TO_SERVER or len(chunk) < KV_FRAME:
            return [chunk]
        self.armed = False
        self.cuts += 1
        if self.then is not None:
            self.then()
        raise Cut(chunk[:len(chunk) // 2])


class Cluster:
    def __init__(self, model: str, logs):
        self.model, self.logs = model, logs
        self.redis = h.RedisServer()
        self.cutter = KVFrameCutter()
        self.relay = RelayThread(self.cutter)
        self.gw_ports = [h.free_port(), h.free_port()]
        self.bases = [f"http://127.0.0.1:{p}" for p in self.gw_ports]
        self.nodes: dict[str, h.Node] = {}

    def start_engine(self, role: str, *extra: str) -> None:
        port = h.free_port()
        self.nodes[role] = h.Node([*role_args(role, self.model, self.redis.url, port, h.free_port()), *extra],
                                  str(self.logs / f"{role}.log")).start()
        return port

    def start_gateway(self, i: int) -> None:
        self.nodes[f"gateway-{i}"] = h.Node(
            h.gateway_args(self.model, self.redis.url, self.gw_ports[i], "--local-prefill-tokens", "0"),
            str(self.logs / f"gateway-{i}.log")).start()

    def wait_engines(self, n: int, i: int = 0, timeout: float = 180) -> None:
        h.wait_until(lambda: h.metric(self.bases[i], "matinee_engines") == n, timeout,
                     f"{n} engines behind gateway {i}", list(self.nodes.values()))

    def body(self, prompt) -> dict:
        return {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True}

    def complete(self, prompt, i: int = 0) -> str:
        status, body = h.http_json("POST", self.bases[i] + "/v1/completions", self.body(prompt))
        assert status == 200, body
        return body["choices"][0]["text"]

    def decode_free(self) -> int:
        return engine_stats(self.redis.url, "decode").kv_blocks_free

    def stop(self) -> None:
        for node in self.nodes.values():
            node.kill()
        self.relay.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    c = Cluster(model, tmp_path_factory.mktemp("disagg-faults-logs"))
    rng = random.Random(23)
    c.prompts = [[rng.randrange(4, 360) for _ in range(PROMPT)] for _ in range(5)]   # the last one for the ahead cut
    try:
        c.redis.start()
        c.start_engine("engine")
        c.start_gateway(0)
        c.wait_engines(1)
        c.expected = [c.complete(p) for p in c.prompts]   # the colocated engine's, alone
        c.nodes.pop("engine").kill()
        # Whole blocks after the prompt: the cuts below land after the first token (the last test's
        # prefill engine sends layer by layer, as by default).
        c.start_engine("prefill", "--no-kv-transfer-by-layer")
        port = c.start_engine("decode", "--num-blocks", str(DECODE_BLOCKS),
                              "--advertise", f"127.0.0.1:{c.relay.port}")
        c.relay.relay.upstream = ("127.0.0.1", port)
        c.start_gateway(1)
        c.wait_engines(2, 0)
        c.wait_engines(2, 1)
        c.free = c.decode_free()
        assert c.free == DECODE_BLOCKS
        yield c
    finally:
        c.stop()


def test_a_connection_cut_halfway_through_the_kv_is_prefilled_again_with_the_same_text(cluster):
    failed = engine_stats(cluster.redis.url, "prefill").kv_handoffs_failed
    cuts = cluster.cutter.cuts
    cluster.cutter.armed = True
    assert cluster.complete(cluster.prompts[0]) == cluster.expected[0]
    assert cluster.cutter.cuts == cuts + 1
    p, d = engine_stats(cluster.redis.url, "prefill"), engine_stats(cluster.redis.url, "decode")
    assert p.kv_handoffs_failed == failed + 1 and d.kv_handoffs_received >= 1   # cut, then handed over again
    h.wait_until(lambda: cluster.decode_free() == cluster.free, 10, "the decode engine's blocks back")


def test_a_full_decode_engine_refuses_and_the_request_waits_for_room(cluster):
    refused = engine_stats(cluster.redis.url, "decode").kv_handoffs_refused
    out: dict[int, str] = {}
    # Two gateways, each sure from the decode engine's stats that it has room: one is wrong. The
    # prefill engine holds both until both are sent, then prefills them in one step.
    prefill = cluster.nodes["prefill"].proc
    prefill.send_signal(h.signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, cluster.complete(cluster.prompts[1 + i], i)))
                   for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)
    finally:
        prefill.send_signal(h.signal.SIGCONT)
    for t in threads:
        t.join(60)
    assert [out.get(0), out.get(1)] == cluster.expected[1:3]
    assert engine_stats(cluster.redis.url, "decode").kv_handoffs_refused >= refused + 1
    h.wait_until(lambda: cluster.decode_free() == cluster.free, 10, "the decode engine's blocks back")


def test_a_prefill_engine_dying_halfway_through_the_kv_leaves_the_decode_engine_to_finish(cluster):
    before = h.metric(cluster.bases[0], "matinee_request_migrations_total")
    cuts = cluster.cutter.cuts
    cluster.cutter.then = cluster.nodes["prefill"].kill
    cluster.cutter.armed = True
    text, errors = h.stream_text(cluster.bases[0] + "/v1/completions", cluster.body(cluster.prompts[3]))
    assert cluster.cutter.cuts == cuts + 1 and cluster.nodes["prefill"].proc.poll() is not None
    assert not errors and text == cluster.expected[3]
    assert h.metric(cluster.bases[0], "matinee_request_migrations_total") > before
    # The half-written reservation went back before (or while) the decode engine served the rest.
    h.wait_until(lambda: cluster.decode_free() == cluster.free, 10, "the decode engine's blocks back")


def test_a_connection_cut_while_the_blocks_go_ahead_is_handed_over_whole_with_the_same_text(cluster):
    """A prefill engine of 8 tokens a step sends a 100-token prompt's blocks ahead, layer by layer; the
    cut lands on the first frame of a block's size. The handoff sent ahead fails quietly, and once the
    prompt is prefilled it is handed over whole on a new connection: nothing fails, no prefill runs
    twice, and the decode engine gets the cut reservation's blocks back."""
    cluster.nodes.pop("prefill").kill()   # the last test's is dead already
    cluster.start_engine("prefill", "--max-num-batched-tokens", "8")
    cluster.wait_engines(2, 0)
    h.wait_until(lambda: cluster.decode_free() == cluster.free, 10, "the decode engine's blocks back")
    received = engine_stats(cluster.redis.url, "decode").kv_handoffs_received
    cuts = cluster.cutter.cuts
    cluster.cutter.then = None
    cluster.cutter.armed = True
    assert cluster.complete(cluster.prompts[4]) == cluster.expected[4]
    assert cluster.cutter.cuts == cuts + 1
    p, d = engine_stats(cluster.redis.url, "prefill"), engine_stats(cluster.redis.url, "decode")
    assert p.kv_handoffs_failed == 0 and p.kv_handoffs_sent == 1 and d.kv_handoffs_received == received + 1
    assert p.prompt_tokens == PROMPT   # prefilled once
    h.wait_until(lambda: cluster.decode_free() == cluster.free, 10, "the decode engine's blocks back")
