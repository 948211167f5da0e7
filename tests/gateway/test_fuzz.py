"""Fuzzing the generation routes: whatever a body holds, the answer is never a 5xx, a stream never
carries an error event, and the next good request is served.

Bodies mix the fields the API knows, filled with plausible values and with junk (huge and
negative numbers, NaN, wrong types, nested junk), plus bytes that are not JSON at all. The
number of examples is bounded so the test takes seconds.
"""
import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.config import GatewayConfig
from tests.gateway import http_util as http

pytestmark = pytest.mark.slow

BIG = [2 ** 31, 2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 63) - 1]
junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 80), 2 ** 80) | st.sampled_from(BIG)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


plausible = {
    "model": st.just("tiny"),
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2) | st.sampled_from([1e-6, 1e-5, 2.0]),
    "top_p": st.floats(1e-6, 1),
    "top_k": st.integers(-1, 368),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2 ** 63), 2 ** 63 - 1),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=4),
    "n": st.integers(1, 16),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(1e-45, 2).filter(lambda x: x > 0) | st.sampled_from([1e-38, 1e-45, 5e-324]),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "user": st.text(max_size=8),
}
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "content": st.text(max_size=40)})
chat_fields = {**plausible, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
               "max_completion_tokens": st.integers(1, 4)}
prompt = (st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 367), min_size=1, max_size=12)
          | st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=4))
completion_fields = {**plausible, "logprobs": st.integers(0, 20)}


@st.composite
def body(draw, required: dict, fields: dict) -> bytes:
    """A plausible body, then up to two fields (known or not) replaced by junk."""
    out = {k: draw(v) for k, v in required.items()}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        out[name] = draw(fields[name])
    if out.get("stream") is True and draw(st.booleans()):
        out["stream_options"] = {"include_usage": draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(sorted({*required, *fields, "stream_options", "zz"})),
                              max_size=2, unique=True)):
        out[name] = draw(junk)
    return json.dumps(out).encode()   # NaN and Infinity come out as bare words: not JSON, also a case


item = message | st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=4),
                                         "output": st.text(max_size=10)})
responses_fields = {"model": plausible["model"], "temperature": plausible["temperature"], "top_p": plausible["top_p"],
                    "stream": plausible["stream"], "user": plausible["user"], "instructions": st.text(max_size=20),
                    "max_output_tokens": st.integers(1, 4), "store": st.booleans(),
                    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
                    "previous_response_id": st.text(max_size=8), "truncation": st.sampled_from(["disabled", "auto"]),
                    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}])}
raw = st.binary(max_size=64) | st.sampled_from([b"", b"{", b"[]", b"null", b'{"messages": [}'])
bodies = (st.tuples(st.just("/v1/chat/completions"),
                    body({"messages": st.lists(message, min_size=1, max_size=3)}, chat_fields))
          | st.tuples(st.just("/v1/completions"), body({"prompt": prompt}, completion_fields))
          | st.tuples(st.just("/v1/responses"),
                      body({"input": st.text(max_size=40) | st.lists(item, min_size=1, max_size=3)}, responses_fields))
          | st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"]), raw))

GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def fuzz_server(tiny_servers):
    return tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny"))


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=bodies)
def test_no_body_gives_a_5xx(fuzz_server, case):
    path, body = case
    r = http.post(fuzz_server + path, content=body, headers={"Content-Type": "application/json"},
                  timeout=60)
    event(f"{path} {r.status_code}")
    assert r.status_code < 500, (path, body[:300], r.text[:300])
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        if path == "/v1/responses":   # OpenAI's named events: a terminal one, no [DONE]
            types = [json.loads(e)["type"] for e in events]
            assert types[-1] in ("response.completed", "response.incomplete"), (body[:300], r.text[-300:])
            assert "error" not in types and "response.failed" not in types
            return
        assert events[-1] == "[DONE]"
        assert not any('"error"' in e for e in events[:-1]), (body[:300], r.text[-300:])


def test_good_requests_are_served_after_the_fuzz(fuzz_server):
    r = http.post(fuzz_server + "/v1/chat/completions", json_body=GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
