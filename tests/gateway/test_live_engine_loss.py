"""An engine that dies mid-stream: the stream ends with an error event and [DONE], later requests
get 503."""
import json

import openai
import pytest

from gateway.config import GatewayConfig
from tests.gateway import http_util as http


def test_engine_death_mid_stream_sends_error_event(tiny_servers):
    live = tiny_servers.live
    proxy = live.spawn_proxy("doomed-scheduler")
    base = live.add_app(GatewayConfig(served_model_name="tiny"), scheduler=proxy)
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 40, "stream": True,
            "ignore_eos": True}
    conn, resp = http.open_request("POST", base + "/v1/completions", json_body=body)
    try:
        assert resp.status == 200
        events = []
        while len(events) < 2:
            line = resp.readline()
            assert line, "the stream ended before any token"
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
        live.stop_actor(proxy)   # the engine, as this gateway knows it, is gone
        rest = resp.read().decode()
    finally:
        conn.close()
    data = [ln[6:] for ln in rest.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]" and rest.count("[DONE]") == 1   # after the error, as vLLM ends it
    last = json.loads(data[-2])
    assert last["error"]["type"] == "service_unavailable" and last["error"]["message"]
    # A lost engine is never a normal-looking finish.
    assert all(c["finish_reason"] is None for d in map(json.loads, data[:-2]) for c in d["choices"])
    assert http.get(base + "/ready").status_code == 503
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert e.value.status_code == 503
