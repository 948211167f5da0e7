"""The OpenAI API over real HTTP on loopback, driven by the official `openai` client.

The engine is a tiny random-weight llama, so text is gibberish: tests check shapes, counts,
reproducibility and stop handling rather than meaning (the SmolLM2 tests check meaning).
"""
import asyncio
import itertools
import json
import re
import time

import msgspec
import openai
import pytest

from gateway import api_types
from tests.gateway import http_util as http
from tests.gateway.conftest import API_KEY

MSG = [{"role": "user", "content": "Hello world! How are you today?"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def metric(base: str, name: str) -> float:
    text = http.get(base + "/metrics", headers=AUTH).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_health_ready_models(tiny_servers, client):
    for path in ("/health", "/ready"):   # unprotected
        assert http.get(tiny_servers.main + path).status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_chat_non_streamed(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == "tiny"
    ch = r.choices[0]
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str)
    assert ch.finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streamed_equals_non_streamed_for_same_seed(client):
    kw = dict(model="tiny", messages=MSG, max_tokens=12, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert len({c.id for c in chunks}) == 1


def conforms(body: bytes, schema: type) -> None:
    """`body` is an instance of the documented struct: its fields have their types, the required ones
    are there, and it carries no field the struct does not name."""
    documented = msgspec.to_builtins(msgspec.json.decode(body, type=schema))

    def within(sent, known, where):
        if isinstance(sent, dict):
            assert isinstance(known, dict), where
            for k, v in sent.items():
                assert k in known, f"{where}.{k} is not in {schema.__name__}"
                within(v, known[k], f"{where}.{k}")
        elif isinstance(sent, list):
            assert isinstance(known, list) and len(sent) == len(known), where
            for i, (a, b) in enumerate(zip(sent, known)):
                within(a, b, f"{where}[{i}]")
        else:
            assert sent == known, where

    within(json.loads(body), documented, schema.__name__)


def sse_events(base: str, path: str, body: dict) -> list[bytes]:
    r = http.post(base + path, json_body=body, headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = [line[len(b"data: "):] for line in r.content.split(b"\n") if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    return data[:-1]


def test_streamed_events_are_the_documented_chunks(tiny_servers):
    """/openapi.json documents a stream as text; its events are api_types' chunk structs, checked here
    as schemathesis checks the whole bodies."""
    common = dict(model="tiny", max_tokens=4, temperature=0, ignore_eos=True, stream=True,
                  stream_options={"include_usage": True})
    chat = sse_events(tiny_servers.main, "/v1/chat/completions",
                      dict(common, messages=MSG, logprobs=True, top_logprobs=2, n=2, prompt_logprobs=1))
    completion = sse_events(tiny_servers.main, "/v1/completions",
                            dict(common, prompt="Hello world", logprobs=2, echo=True, prompt_logprobs=1))
    for events, schema, kind in ((chat, api_types.ChatCompletionChunk, "chat.completion.chunk"),
                                 (completion, api_types.Completion, "text_completion")):
        assert len(events) >= 4 + 1   # an event a token at least, and the usage
        for event in events:
            conforms(event, schema)
            assert json.loads(event)["object"] == kind
    whole = http.post(tiny_servers.main + "/v1/chat/completions", headers=AUTH,
                      json_body=dict(model="tiny", max_tokens=4, messages=MSG, logprobs=True, top_logprobs=2))
    assert whole.status_code == 200
    conforms(whole.content, api_types.ChatCompletion)


def test_seed_reproducible_and_seeds_differ(client):
    def text(seed):
        return client.completions.create(model="tiny", prompt="One two three", max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a, b = text(7), text(7)
    assert a == b
    assert any(text(s) != a for s in (8, 9, 10))


def test_completions_prompt_forms(client, tiny_servers):
    ids = tiny_servers.tokenizer.encode("The quick brown fox")
    r = client.completions.create(model="tiny", prompt=["The quick", "brown fox"], max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 6
    by_text = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_text.choices[0].text
    assert chunks[-1].usage.completion_tokens == 4


def test_n_two_samples(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, n=2,
                                       temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12
    assert r.choices[0].message.content != r.choices[1].message.content
    seen = {0: "", 1: ""}
    for c in client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, n=2,
                                            temperature=1.0, seed=3, stream=True,
                                            extra_body={"ignore_eos": True}):
        for ch in c.choices:
            seen[ch.index] += ch.delta.content or ""
    assert seen == {i: r.choices[i].message.content for i in (0, 1)}


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        # greedy: the sampled token is the most likely one
        assert t.logprob == pytest.approx(max(x.logprob for x in t.top_logprobs), abs=1e-5)
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == c.choices[0].text


def test_stop_strings_cut_output(client):
    kw = dict(model="tiny", messages=MSG, max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    assert len(full) > 12
    stop = full[6:10]
    want = full[:full.find(stop)]
    r = client.chat.completions.create(**kw, stop=[stop, "never-there"])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_prefix_cache_reported_as_cached_tokens(client):
    prompt = "In the beginning the model read every token, then it cached them in blocks. " * 6
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens > 32
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_tokenize_detokenize(tiny_servers):
    text = "Hello world! 😀 東京"
    t = http.post(tiny_servers.main + "/tokenize", headers=AUTH, json_body={"prompt": text}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] > 0
    d = http.post(tiny_servers.main + "/detokenize", headers=AUTH, json_body={"tokens": t["tokens"]})
    assert d.json()["prompt"] == text


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 1000}, "n"),
    ({"stop": ["s"] * 100}, "stop"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
    ({"extra_body": {"guided_grammar": "root ::= missing"}}, "guided_grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos"),
])
def test_bad_requests_are_400_naming_param(client, kwargs, param):
    args = {"model": "tiny", "messages": MSG, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]


def test_openai_client_requests_with_accepted_fields_are_served(client):
    """What the openai client sends, with the accepted-but-unused fields, is not a 400."""
    r = client.chat.completions.create(model="tiny", messages=MSG, max_completion_tokens=2, n=2,
                                       seed=1, user="u", safety_identifier="s",
                                       reasoning_effort="low", stream=False)
    assert len(r.choices) == 2
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, user="u", best_of=1)
    assert r.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None


def test_context_length_exceeded(client, tiny_servers):
    ids = [5] * 1100
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=ids, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5] * 1000, max_tokens=100)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:   # long text: tokenized off the event loop
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello " * 2000}])
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-99", messages=MSG)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"


def test_api_key_required(tiny_servers):
    bad = openai.OpenAI(base_url=tiny_servers.main + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="tiny", messages=MSG)
    assert e.value.body["code"] == "invalid_api_key"
    for path in ("/metrics", "/v1/models"):
        r = http.get(tiny_servers.main + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"


def test_body_over_cap_is_413(tiny_servers):
    r = http.post(tiny_servers.limits + "/v1/chat/completions",
                  json_body={"model": "tiny", "messages": [{"role": "user", "content": "x" * 10000}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_no_engine_is_503(tiny_servers):
    assert http.get(tiny_servers.down + "/ready").status_code == 503
    r = http.post(tiny_servers.down + "/v1/chat/completions", json_body={"messages": MSG})
    assert r.status_code == 503 and "error" in r.json()
    # validation still comes first, even without an engine
    r = http.post(tiny_servers.down + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


_long_prompts = itertools.count(20)


def _long_stream(base: str):
    """A streamed request whose long prompt keeps it waiting for many 32-token prefill chunks. Each
    prompt is new: one the prefix cache still held from an earlier call would skip the prefill (and
    with it the wait)."""
    first = next(_long_prompts)
    body = {"model": "tiny", "prompt": [first] + [7] * 959, "max_tokens": 2, "stream": True}
    return http.open_request("POST", base + "/v1/completions", json_body=body)


def test_queue_full_is_429_with_retry_after(tiny_servers):
    for _ in range(5):   # the first request must still be prefilling when the second arrives
        conn, first = _long_stream(tiny_servers.limits)
        assert first.status == 200   # headers came: it is submitted and waiting
        r = http.post(tiny_servers.limits + "/v1/completions",
                      json_body={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        first.read()
        conn.close()
        if r.status_code == 429:
            break
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"


def test_idle_stream_gets_ping_comments(tiny_servers):
    conn, resp = _long_stream(tiny_servers.limits)
    try:
        assert resp.getheader("content-type").startswith("text/event-stream")
        assert resp.getheader("cache-control") == "no-cache"
        assert resp.getheader("x-accel-buffering") == "no"
        body = resp.read().decode()
    finally:
        conn.close()
    assert ": ping\n\n" in body
    assert body.rstrip().endswith("data: [DONE]")


def test_disconnect_frees_kv_blocks(tiny_servers):
    base = tiny_servers.main
    free_before = metric(base, "matinee_kv_blocks_free")
    body = {"model": "tiny", "prompt": "The quick brown fox " * 10, "max_tokens": 800,
            "stream": True, "ignore_eos": True}
    conn, resp = http.open_request("POST", base + "/v1/completions", json_body=body, headers=AUTH)
    assert resp.status == 200
    got = 0
    while got < 3:
        line = resp.readline()
        assert line, "the stream ended early"
        got += line.startswith(b"data: ")
    assert metric(base, "matinee_kv_blocks_free") < free_before
    conn.close()   # hang up mid-stream
    assert_all_freed(base, free_before)


def assert_all_freed(base: str, free_before: float) -> None:
    """Within 20 s of a hang-up, the engine has every KV block back and runs nothing."""
    deadline = time.monotonic() + 20
    while metric(base, "matinee_kv_blocks_free") != free_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(base, "matinee_kv_blocks_free") == free_before
    assert metric(base, "matinee_requests_running") == 0


def test_64_concurrent_streams_finish(tiny_servers):
    async def go():
        c = openai.AsyncOpenAI(base_url=tiny_servers.main + "/v1", api_key=API_KEY, max_retries=0,
                               timeout=120)

        async def one(i):
            finish, text = None, ""
            stream = await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Request {i}"}],
                max_tokens=8, stream=True, seed=i, extra_body={"ignore_eos": True})
            async for chunk in stream:
                for ch in chunk.choices:
                    text += ch.delta.content or ""
                    finish = ch.finish_reason or finish
            return finish

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await c.close()

    assert asyncio.run(go()) == ["length"] * 64


def test_metrics_names_and_counts(tiny_servers, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=2)
    text = http.get(tiny_servers.main + "/metrics", headers=AUTH).text
    for name in ("matinee_requests_running", "matinee_requests_waiting", "matinee_kv_blocks_total",
                 "matinee_kv_blocks_free", "matinee_prefix_cache_queried_tokens_total",
                 "matinee_prefix_cache_hit_tokens_total", "matinee_prompt_tokens_total",
                 "matinee_generation_tokens_total", "matinee_preemptions_total",
                 "matinee_requests_total", "matinee_time_to_first_token_seconds_bucket",
                 "matinee_inter_token_latency_seconds_bucket", "matinee_e2e_request_latency_seconds_count",
                 "matinee_request_queue_seconds_count"):
        assert re.search(rf"^{name}[{{ ]", text, re.M), name
    assert metric(tiny_servers.main, "matinee_kv_blocks_total") == 512
    assert metric(tiny_servers.main, "matinee_generation_tokens_total") >= 2
    assert metric(tiny_servers.main, "matinee_e2e_request_latency_seconds_count") >= 1


def test_metrics_state_the_kv_pool(tiny_servers):
    """The pool's tokens and a token's K/V bytes over all layers (float32 here: no scales)."""
    cfg = tiny_servers.live.engine.model_config
    assert metric(tiny_servers.main, "matinee_kv_token_capacity") == 512 * 16
    per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * 4
    assert metric(tiny_servers.main, "matinee_kv_bytes_per_token") == per_token


def test_stop_string_ends_one_of_two_samples(client):
    kw = dict(model="tiny", prompt="One two three four five six seven eight nine ten. " * 3,
              max_tokens=24, n=2, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    full = [c.text for c in sorted(client.completions.create(**kw).choices, key=lambda c: c.index)]
    assert len(full[0]) > 10
    stop = full[0][5:8]
    r = client.completions.create(**kw, stop=stop)
    for c in r.choices:
        text = full[c.index]
        cut = text.find(stop)
        assert c.text == (text[:cut] if cut >= 0 else text)
        assert c.finish_reason == ("stop" if cut >= 0 else "length")


def _ids(tiny_servers, text: str) -> list[int]:
    return http.post(tiny_servers.main + "/tokenize", headers=AUTH,
                     json_body={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_logit_bias_min_tokens_and_stop_token_ids(client, tiny_servers):
    kw = dict(model="tiny", prompt=[5, 6, 7, 8], temperature=0)
    forced = client.completions.create(**kw, max_tokens=3, logit_bias={"9": 100},
                                       extra_body={"ignore_eos": True})
    assert _ids(tiny_servers, forced.choices[0].text) == [9, 9, 9]
    greedy = client.completions.create(**kw, max_tokens=1, extra_body={"ignore_eos": True})
    (g,) = _ids(tiny_servers, greedy.choices[0].text)
    other = client.completions.create(**kw, max_tokens=1, logit_bias={str(g): -100},
                                      extra_body={"ignore_eos": True})
    assert other.choices[0].text != greedy.choices[0].text
    # EOS (2) forced by its bias still cannot end the sample before min_tokens.
    held = client.completions.create(**kw, max_tokens=8, logit_bias={"2": 100},
                                     extra_body={"min_tokens": 3})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4
    stopped = client.completions.create(**kw, max_tokens=8, logit_bias={"9": 100},
                                        extra_body={"stop_token_ids": [9], "ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, max_tokens=2, logit_bias={"99999999": 1})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, max_tokens=2, logit_bias={"1": 101})
    assert e.value.body["param"] == "logit_bias.1"


def test_each_token_is_a_chunk_even_while_its_text_is_held_back(client):
    # The tiny model's byte-level tokens often end halfway through a character: no text yet, and
    # still a chunk (as vLLM streams them), so a client times every token.
    kw = dict(model="tiny", max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True},
              extra_body={"ignore_eos": True})
    texts = []
    for prompt in ("Hello world!", "One two three", "def add(a, b):"):
        chunks = list(client.completions.create(prompt=prompt, **kw))
        tokens = [c for c in chunks if c.choices]
        assert len(tokens) == chunks[-1].usage.completion_tokens == 40
        texts += [c.choices[0].text for c in tokens]
        chat = list(client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw))
        assert len([c for c in chat if c.choices]) == 1 + chat[-1].usage.completion_tokens   # the role first
    assert "" in texts   # some token's text was held back, or this proves nothing
