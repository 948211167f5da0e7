"""A network attacker against real processes (two engines and a gateway, a private redis-server):
registry entries it forges are never dialed, and a relay it places on one engine's path, which
forwards the handshake untouched, then injects a forged AbortRequest and replays what it saw,
neither learns the prompt nor changes the answer."""
from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import redis

from actors.messages.front_end import AbortRequest, SubmitRequest  # registered: the frames below decode
from runtime.codec import Codec, current_frames
from runtime.ref import DeadRef
from tests.cluster import harness as h
from tests.runtime.relay import TO_SERVER, Relay

pytestmark = pytest.mark.slow

CONTENT = ("The quick brown fox jumps over the lazy dog. In the beginning the model read every token, "
           "then it cached them in blocks.")


def frame(obj) -> bytes:
    payload = msgspec.msgpack.encode(obj)
    return len(payload).to_bytes(4, "big") + payload


class AbortInjector:
    """Towards the engine: after the first request-sized chunk, a replay of it and an AbortRequest
    for that request (its id read off the wire where the wire is plaintext, guessed where not)."""

    def __init__(self):
        self.front_path = ""
        self.decoder = Codec(DeadRef).decoder
        self.injected = 0

    def __call__(self, direction: str, index: int, chunk: bytes) -> list[bytes]:
        if direction != TO_SERVER or index == 0 or self.injected or len(chunk) < 150:
            return [chunk]
        try:
            decoded = self.decoder.decode(chunk[4:])
        except (msgspec.DecodeError, msgspec.ValidationError):
            request_id = "0" * 32   # sealed: nothing to read
        else:
            items = getattr(decoded, "items", [decoded])
            ids = [f.msg.request_id for f in items if isinstance(getattr(f, "msg", None), SubmitRequest)]
            if not ids:
                return [chunk]
            request_id = ids[0]
        abort = current_frames()[1].tell[AbortRequest](self.front_path, AbortRequest(request_id))
        self.injected += 1
        return [chunk, chunk, frame(abort)]


class RelayThread:
    """A Relay on an event loop of its own, beside these synchronous tests."""

    def __init__(self, tamper=None):
        self.relay = Relay(tamper)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._call(self.relay.start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stop(self) -> None:
        self._call(self.relay.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("wire-tiny")))


class Cluster:
    """One engine reached directly, one that advertises the relay's address (the relay forwards to
    it), and a gateway routing round robin, so two requests in a row take one path each."""

    def __init__(self, model: str, logs):
        self.redis = h.RedisServer()
        self.attacker = AbortInjector()
        self.relay = RelayThread(self.attacker)
        direct, relayed, gw = h.free_port(), h.free_port(), h.free_port()
        self.relay.relay.upstream = ("127.0.0.1", relayed)
        self.base = f"http://127.0.0.1:{gw}"
        self.nodes = [
            h.Node(h.engine_args(model, self.redis.url, direct), str(logs / "direct.log")),
            h.Node([*h.engine_args(model, self.redis.url, relayed), "--advertise", f"127.0.0.1:{self.relay.port}"],
                   str(logs / "relayed.log")),
            h.Node(h.gateway_args(model, self.redis.url, gw, "--routing", "round_robin"), str(logs / "gateway.log")),
        ]
        self.relayed_id = f"engine-{relayed}"

    def start(self) -> None:
        self.redis.start()
        for node in self.nodes:
            node.start()
        h.wait_until(lambda: h.metric(self.base, "matinee_engines") == 2, 180, "2 engines behind the gateway",
                     self.nodes)
        self.attacker.front_path = self.entries()[f"engines/{self.relayed_id}"][1]

    def entries(self) -> dict:
        from runtime.redis_registry import RedisRegistry

        async def read():
            registry = RedisRegistry(self.redis.url, secret=h.SECRET)
            try:
                return await registry.entries("engines/")
            finally:
                await registry.close()
        return asyncio.run(read())

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        self.relay.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    c = Cluster(model, tmp_path_factory.mktemp("wire-logs"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def chat(cluster: Cluster, content: str = CONTENT) -> dict:
    status, body = h.http_json("POST", cluster.base + "/v1/chat/completions",
                               {"model": "tiny", "messages": [{"role": "user", "content": content}],
                                "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    return body


def test_a_forged_registry_entry_is_never_dialed(cluster):
    from runtime import auth

    bait = RelayThread()
    bait.relay.upstream = ("127.0.0.1", 9)   # never reached: nobody should dial the bait
    try:
        (node, path), = [v for k, v in cluster.entries().items() if k.endswith(cluster.relayed_id)]
        forged = f"127.0.0.1:{bait.port}"
        key = "matinee:registry:engines/"
        wrong = auth.registry_key(b"not-the-secret")
        r = redis.Redis.from_url(cluster.redis.url)
        r.set(key + "unsigned", msgspec.json.encode([forged, path]))
        r.set(key + "wrong-secret", msgspec.json.encode(
            [forged, path, auth.entry_mac(wrong, key + "wrong-secret", forged, path).hex()]))
        r.close()
        time.sleep(2.0)   # four discovery rounds
        assert bait.relay.connections == 0
        assert h.metric(cluster.base, "matinee_engines") == 2
        assert chat(cluster, "Hello world!")["choices"][0]["finish_reason"] == "length"
    finally:
        bait.stop()


def test_a_relay_on_the_path_learns_nothing_and_changes_nothing(cluster, model):
    from actors.text.tokenizer import load_tokenizer

    migrations = h.metric(cluster.base, "matinee_request_migrations_total")
    answers = [chat(cluster) for _ in range(2)]   # round robin: one direct, one through the relay
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 0]   # two engines
    direct, relayed = (a["choices"][0] for a in answers)
    assert relayed["message"]["content"] == direct["message"]["content"]
    assert direct["finish_reason"] == relayed["finish_reason"] == "length"
    assert cluster.relay.relay.connections == 1 and cluster.attacker.injected == 1
    # Each was served where it was sent: none was refused or lost and moved to the other engine.
    assert h.metric(cluster.base, "matinee_request_migrations_total") == migrations
    assert h.metric(cluster.base, "matinee_engines") == 2
    # What the prompt looks like on a plaintext wire: its token ids as msgpack integers.
    tokenizer = load_tokenizer(model)
    ids = tokenizer.encode(CONTENT, add_special_tokens=False)[1:-1]
    needle = b"".join(msgspec.msgpack.encode(i) for i in ids)
    assert needle in msgspec.msgpack.encode(tokenizer.apply_chat_template([{"role": "user", "content": CONTENT}]))
    captured = bytes(cluster.relay.relay.captured)
    assert needle not in captured
    assert CONTENT[:20].encode() not in captured
