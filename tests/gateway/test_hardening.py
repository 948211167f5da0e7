"""What a careless or hostile client cannot do to the gateway: bad numbers and deep JSON are 400s,
slow clients time out, one request cannot fill the queue, tenants do not see each other's prefix
cache, long text is tokenized off the loop, and a failed request says so instead of finishing."""
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import msgspec
import pytest

from actors.messages.front_end import AbortRequest, SubmitRequest, TokenDeltas
from gateway.config import GatewayConfig
from runtime import Actor
from tests.gateway import http_util as http

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def _post(base: str, path: str, body, **kw) -> http.Reply:
    return http.post(base + path, json_body=body, **kw)


@pytest.fixture(scope="module")
def open_server(tiny_servers):
    """A gateway without an API key: any bearer token names a tenant."""
    return tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny"))


# An unknown field is refused before its value is read, so its depth never matters.
@pytest.mark.parametrize("path,body,says", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     "`x`"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests too deeply"),
    ("/v1/completions", b'{"prompt": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}", "nests too deeply"),
    ("/tokenize", b'{"prompt": "x", "y": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}", "`y`"),
])
def test_deep_json_is_400(open_server, path, body, says):
    r = http.post(open_server + path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert _post(open_server, "/v1/chat/completions", CHAT).status_code == 200


@pytest.mark.parametrize("field,value", [
    ("priority", 2 ** 64), ("priority", -(2 ** 70)), ("priority", 40000),
    ("top_k", 2 ** 64), ("top_k", 10 ** 6), ("seed", 2 ** 64), ("max_tokens", 2 ** 64),
    ("n", 2 ** 64), ("top_logprobs", 2 ** 64),
])
def test_numbers_out_of_range_are_400_naming_the_field(open_server, field, value):
    body = {**CHAT, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    r = _post(open_server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in (field, "messages")   # max_tokens: the context check


def test_priority_needs_priority_scheduling(open_server):
    r = _post(open_server, "/v1/chat/completions", {**CHAT, "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "priority scheduling is not enabled" in r.json()["error"]["message"]
    assert _post(open_server, "/v1/chat/completions", {**CHAT, "priority": 0}).status_code == 200


def test_prompts_times_n_is_capped(open_server):
    r = _post(open_server, "/v1/completions", {"model": "tiny", "prompt": ["a b"] * 9, "n": 16,
                                               "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "144 sequences" in r.json()["error"]["message"]
    r = _post(open_server, "/v1/completions", {"model": "tiny", "prompt": ["a b"] * 8, "n": 16,
                                               "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 128


def test_the_queue_limit_counts_sequences_not_requests(tiny_servers):
    """A gateway whose queue holds 4 sequences: a request of 2 prompts x n=2 that has not started
    fills it, so the next request waits its turn with a 429, whatever its own size."""
    held = HoldingProxy.spawn(tiny_servers.live)
    base = tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny", max_waiting=4),
                                     scheduler=held)
    body = {"model": "tiny", "prompt": ["a b", "c d"], "n": 2, "max_tokens": 2}
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(r=_post(base, "/v1/completions", body)))
    t.start()
    try:
        _wait_for(lambda: tiny_servers.live.run(held_count(held)) == 2)
        r = _post(base, "/v1/completions", {"model": "tiny", "prompt": "e f", "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    finally:
        tiny_servers.live.run(release(held))
        t.join(60)
    assert first["r"].status_code == 200 and len(first["r"].json()["choices"]) == 4
    assert _post(base, "/v1/completions", {"model": "tiny", "prompt": "e f", "max_tokens": 1}).status_code == 200


def test_a_full_queue_refuses_before_any_grammar_is_compiled(tiny_servers):
    """With the queue full, a request with a grammar gets its 429 at once: a broken grammar, which
    compiling would turn into a 400, shows that nothing compiled it first."""
    held = HoldingProxy.spawn(tiny_servers.live, name="holding-proxy-grammar")
    base = tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny", max_waiting=1), scheduler=held)
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(r=_post(base, "/v1/completions",
                                                             {"model": "tiny", "prompt": "a b", "max_tokens": 2})))
    t.start()
    try:
        _wait_for(lambda: tiny_servers.live.run(held_count(held)) == 1)
        for path, body in (("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}),
                           ("/v1/chat/completions", CHAT)):
            r = _post(base, path, {**body, "structured_outputs": {"grammar": "root ::= (unclosed"}})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    finally:
        tiny_servers.live.run(release(held))
        t.join(60)
    assert first["r"].status_code == 200
    r = _post(base, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2,
                                        "structured_outputs": {"grammar": "root ::= (unclosed"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.grammar", r.text


@pytest.mark.parametrize("field", ["regex", "grammar", "json"])
def test_a_grammar_longer_than_the_limit_is_a_400_naming_it(tiny_servers, field):
    base = tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny", max_grammar_chars=1000))
    value = {"regex": "a" * 1001, "grammar": 'root ::= "' + "a" * 1000 + '"',
             "json": {"type": "object", "description": "a" * 1000}}[field]
    r = _post(base, "/v1/chat/completions", {**CHAT, "structured_outputs": {field: value}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"structured_outputs.{field}" and error["code"] == "grammar_too_large"
    assert "at most 1000" in error["message"] and "--max-grammar-chars" in error["message"]
    ok = {"regex": "a" * 1000, "grammar": 'root ::= "' + "a" * 900 + '"', "json": {"type": "object"}}[field]
    r = _post(base, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1,
                                        "structured_outputs": {field: ok}})
    assert r.status_code == 200, r.text


def test_a_grammar_that_compiles_too_slowly_is_a_400_naming_the_limit(tiny_servers, open_server):
    """A 39 KB regex takes tens of milliseconds to compile; under a 5 ms limit it is refused in
    about that time, and under the default limit the same regex is served."""
    regex = "(" + "|".join(f"x{i}y+" for i in range(5000)) + f"){time.monotonic_ns()}"   # not cached
    fast = tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny", grammar_timeout_s=0.005))
    start = time.monotonic()
    r = _post(fast, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1,
                                        "structured_outputs": {"regex": regex}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs.regex" and error["code"] == "grammar_timeout"
    assert "0.005 s" in error["message"] and "--grammar-timeout" in error["message"]
    assert time.monotonic() - start < 1.0
    r = _post(open_server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1,
                                               "structured_outputs": {"regex": regex + "z"}})
    assert r.status_code == 200, r.text


def test_tenants_do_not_share_the_prefix_cache(open_server):
    prompt = "tenant isolation " * 12   # several full blocks

    def cached(key: str) -> int:
        r = _post(open_server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1},
                  headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("tenant-a")
    assert cached("tenant-a") > 0          # a tenant still hits its own cache
    assert cached("tenant-b") == 0         # and learns nothing of another's


def test_long_tokenize_runs_off_the_event_loop(open_server):
    """While a 1 MB prompt is tokenized, the same gateway keeps answering other requests."""
    text = "hello world, the quick brown fox jumps. " * 25_000
    done = threading.Event()
    answered_meanwhile = []

    def probe():
        while not done.is_set():
            if http.get(open_server + "/health", timeout=30).status_code == 200 and not done.is_set():
                answered_meanwhile.append(time.monotonic())
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        r = _post(open_server, "/tokenize", {"model": "tiny", "prompt": text}, timeout=120)
    finally:
        done.set()
        prober.join(60)
    assert r.status_code == 200 and r.json()["count"] > 100_000
    assert len(answered_meanwhile) >= 3


@pytest.fixture(scope="module")
def impatient(tiny_servers):
    return tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny", read_timeout_s=0.5))


def _raw(base: str) -> socket.socket:
    u = urlsplit(base)
    s = socket.create_connection((u.hostname, u.port), timeout=20)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_half_sent_headers_are_dropped(impatient):
    s = _raw(impatient)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        for _ in range(4):   # trickling more header lines does not keep it open
            time.sleep(0.2)
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
        assert _read_all(s) == b""   # closed by the server, no request was ever handled
        assert time.monotonic() - start < 15
    finally:
        s.close()
    assert _post(impatient, "/v1/chat/completions", CHAT).status_code == 200


def test_half_sent_body_gets_408_and_is_closed(impatient):
    s = _raw(impatient)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 500\r\n\r\n{\"messages\": [")
        reply = _read_all(s)
    finally:
        s.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert _post(impatient, "/v1/chat/completions", CHAT).status_code == 200


class FailingProxy(Actor):
    """Stands in front of the real scheduler and, after each request's first delta, ends it with
    `reason`: "error" as the engine does when a sample cannot be computed, or an "abort" the
    gateway never asked for."""

    def __init__(self, target, reason: str) -> None:
        self.target = target
        self.reason = reason
        self.reply_to: dict[str, object] = {}

    async def receive(self, msg):
        match msg:
            case SubmitRequest():
                self.reply_to[msg.request_id] = msg.reply_to
                self.target.tell(msgspec.structs.replace(msg, reply_to=self.context.self_ref))
            case TokenDeltas(deltas=deltas):
                for d in deltas:
                    to = self.reply_to.pop(d.request_id, None)
                    if to is None:
                        continue
                    to.tell(TokenDeltas([d]))
                    if d.finish_reason is None:
                        error = "The engine could not compute this sample." if self.reason == "error" else None
                        to.tell(TokenDeltas([msgspec.structs.replace(
                            d, token_ids=[], logprobs=None, finish_reason=self.reason, error=error)]))
                    self.target.tell(AbortRequest(d.request_id))
            case _:
                return await self.target.ask(msg)


@pytest.fixture(scope="module", params=["error", "abort"])
def failing(tiny_servers, request):
    live = tiny_servers.live
    proxy = FailingProxy(live.engine.scheduler, request.param)
    ref = live.run(live.engine.system.spawn(proxy, name=f"failing-proxy-{request.param}"))
    return live.add_app(GatewayConfig(served_model_name="tiny"), scheduler=ref), request.param


def _failure_message(reason: str) -> str:
    return ("The engine could not compute this sample." if reason == "error"
            else "The engine ended this request before it finished.")


def test_a_failed_stream_ends_with_an_error_event_then_done(failing):
    failing, reason = failing
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 20, "ignore_eos": True, "stream": True}
    r = _post(failing, "/v1/completions", body)
    assert r.status_code == 200
    data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["type"] == "internal_server_error" and err["message"] == _failure_message(reason)
    assert all(c["finish_reason"] is None for d in map(json.loads, data[:-2]) for c in d["choices"])


def test_a_failed_request_is_a_500_not_a_finish(failing):
    failing, reason = failing
    r = _post(failing, "/v1/chat/completions", {**CHAT, "max_tokens": 20, "ignore_eos": True})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == _failure_message(reason)


# ---- helpers ------------------------------------------------------------------------------------

class HoldingProxy(Actor):
    """Holds every SubmitRequest until released: requests stay waiting for as long as a test needs."""

    def __init__(self, target) -> None:
        self.target = target
        self.held: list = []
        self.holding = True

    @classmethod
    def spawn(cls, live, name: str = "holding-proxy"):
        return live.run(live.engine.system.spawn(cls(live.engine.scheduler), name=name))

    async def receive(self, msg):
        match msg:
            case SubmitRequest() if self.holding:
                self.held.append(msg)
            case "count":
                return len(self.held)
            case "release":
                self.holding = False
                for m in self.held:
                    self.target.tell(m)
                self.held.clear()
            case SubmitRequest():
                self.target.tell(msg)
            case _:
                return await self.target.ask(msg)


async def held_count(ref) -> int:
    return await ref.ask("count")


async def release(ref) -> None:
    await ref.ask("release")


def _wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
