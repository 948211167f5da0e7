"""The requests `vllm bench serve` (vLLM 0.32's benchmarks/lib/endpoint_request_func.py and
serve.py) sends, replayed over real HTTP with their exact JSON shapes, and read as it reads them.

vLLM is not a dependency of this project, so its client cannot run in the suite; these bodies are
copied from it. The random dataset sets `ignore_eos`, and `--temperature` and the other sampling
flags go in as extra body; before the run, the prompts are aligned through /tokenize and
/detokenize. Each backend counts a request as failed on a non-200, on a stream without a token,
or (Responses) without a terminal event.
"""
import json

import pytest

from tests.gateway import http_util as http
from tests.gateway.conftest import API_KEY

PROMPT = "alpha beta gamma delta epsilon zeta eta theta"
SAMPLING = {"ignore_eos": True, "temperature": 0.0, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
OUTPUT_LEN = 8


def _stream(url: str, body: dict) -> list[dict]:
    headers = {"Authorization": f"Bearer {API_KEY}", "x-request-id": "bench-4836566b-0"}
    conn, resp = http.open_request("POST", url, json_body=body, headers=headers)
    try:
        assert resp.status == 200, resp.read()
        lines = resp.read().decode().splitlines()
    finally:
        conn.close()
    data = [line[6:] for line in lines if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"]


def test_the_prompt_alignment_round_trips_through_tokenize_and_detokenize(tiny_servers):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    tok = http.post(tiny_servers.main + "/tokenize", headers=auth,
                    json_body={"model": "tiny", "prompt": PROMPT, "add_special_tokens": False})
    assert tok.status_code == 200, tok.text
    detok = http.post(tiny_servers.main + "/detokenize", headers=auth,
                      json_body={"model": "tiny", "tokens": tok.json()["tokens"]})
    assert detok.status_code == 200 and detok.json()["prompt"] == PROMPT


def test_backend_openai_chat(tiny_servers):
    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
            "max_completion_tokens": OUTPUT_LEN, "stream": True, "stream_options": {"include_usage": True},
            **SAMPLING}
    chunks = _stream(tiny_servers.main + "/v1/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text and chunks[-1]["usage"]["completion_tokens"] == OUTPUT_LEN


@pytest.mark.parametrize("backend", ["vllm", "openai"])
def test_backend_completions(tiny_servers, backend):
    body = {"model": "tiny", "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": OUTPUT_LEN,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, **SAMPLING}
    chunks = _stream(tiny_servers.main + "/v1/completions", body)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text and chunks[-1]["usage"]["completion_tokens"] == OUTPUT_LEN


def test_backend_openai_responses(tiny_servers):
    body = {"model": "tiny", "input": PROMPT, "max_output_tokens": OUTPUT_LEN, "stream": True, "store": False,
            **SAMPLING}
    events = _stream(tiny_servers.main + "/v1/responses", body)
    assert any(e["type"] == "response.output_text.delta" for e in events)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["usage"]["output_tokens"] == OUTPUT_LEN
    assert not any(e["type"] == "error" or e.get("error") for e in events[:-1])
