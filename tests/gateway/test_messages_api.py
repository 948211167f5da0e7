"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over real HTTP, driven by the
`anthropic` SDK unchanged, against the tiny random-weight llama (gibberish text): each test checks
shapes, counts, stop reasons and what the chat route gives for the same request."""
import json
import threading

import anthropic
import jsonschema
import pytest

from gateway.config import GatewayConfig
from tests.gateway import http_util as http
from tests.gateway.conftest import API_KEY

HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
GREEDY = dict(model="tiny", temperature=0)
# The SDK's `create` has no sampling arguments any more; the API takes them, so they go as extra body.
T0 = dict(model="tiny", extra_body={"temperature": 0})
ASK = [{"role": "user", "content": "Hello world! How are you today?"}]
FORECAST = {"name": "get_forecast", "description": "The weather forecast for a city",
            "input_schema": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                             "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}


@pytest.fixture(scope="module")
def claude(tiny_servers):
    """The SDK as an agent uses it: it sends the key as `x-api-key`."""
    return anthropic.Anthropic(base_url=tiny_servers.main, api_key=API_KEY, max_retries=0, timeout=120)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _chat(client, messages, **kw):
    return client.chat.completions.create(messages=messages, **GREEDY, **kw).choices[0]


def test_a_message_is_the_chat_routes_reply_in_anthropics_shape(claude, client):
    system = "You answer briefly."
    r = claude.messages.create(max_tokens=8, system=system, messages=ASK, **T0)
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny" and r.id.startswith("msg_")
    chat = _chat(client, [{"role": "system", "content": system}] + ASK, max_tokens=8)
    assert _text(r) == chat.message.content
    assert [b.type for b in r.content] == (["text"] if chat.message.content else [])
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.finish_reason]
    assert r.stop_sequence is None
    assert 0 < r.usage.output_tokens <= 8 and r.usage.input_tokens + r.usage.cache_read_input_tokens > 10
    # System as text blocks renders as the string does; cache markers change nothing.
    blocks = claude.messages.create(max_tokens=8, messages=ASK, cache_control={"type": "ephemeral"}, **T0,
                                    system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}])
    assert _text(blocks) == _text(r)


def test_max_tokens_ends_with_stop_reason_max_tokens(claude, client):
    assert _chat(client, ASK, max_tokens=3).finish_reason == "length"   # greedy runs past 3 tokens here
    r = claude.messages.create(max_tokens=3, messages=ASK, **T0)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(claude):
    full = _text(claude.messages.create(max_tokens=16, messages=ASK, **T0))
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].strip() == full[i:i + 2])
    r = claude.messages.create(max_tokens=16, messages=ASK, stop_sequences=["never-there", stop], **T0)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert _text(r) == full[:full.index(stop)]
    with claude.messages.stream(max_tokens=16, messages=ASK, stop_sequences=[stop], **T0) as s:
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, _text(streamed)) == (r.stop_reason, stop, _text(r))


def test_a_streamed_message_sends_anthropics_events_and_the_same_message(claude):
    whole = claude.messages.create(max_tokens=10, messages=ASK, **T0)
    with claude.messages.stream(max_tokens=10, messages=ASK, **T0) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert _text(final) == _text(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    if _text(whole):
        assert types[1] == "content_block_start" and types[-3] == "content_block_stop"
    # create(stream=True): the raw events, in order.
    raw = list(claude.messages.create(max_tokens=10, messages=ASK, stream=True, **T0))
    assert "".join(e.delta.text for e in raw if e.type == "content_block_delta") == _text(whole)
    assert raw[-2].delta.stop_reason == whole.stop_reason and raw[-2].usage.output_tokens == whole.usage.output_tokens


def test_the_stream_is_named_events_without_done(tiny_servers):
    r = http.post(tiny_servers.main + "/v1/messages", headers=HEADERS,
                  json_body={"model": "tiny", "max_tokens": 4, "messages": ASK, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert "[DONE]" not in r.text
    for e in events:
        name, data = e.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == name[7:]
    assert events[0].startswith("event: message_start") and events[-1].startswith("event: message_stop")


def _forced_call(claude, stream: bool, **kw):
    args = dict(max_tokens=200, messages=[{"role": "user", "content": "Forecast for Paris?"}], tools=[FORECAST],
                tool_choice={"type": "any", "disable_parallel_tool_use": True}, **T0, **kw)
    if not stream:
        return claude.messages.create(**args)
    with claude.messages.stream(**args) as s:
        deltas = [e.delta.partial_json for e in s if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        final = s.get_final_message()
    assert deltas and json.loads("".join(deltas)) == final.content[-1].input
    return final


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_forces_a_valid_call_and_a_tool_result_gets_an_answer(claude, stream):
    r = _forced_call(claude, stream)
    assert r.stop_reason == "tool_use"
    calls = [b for b in r.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_forecast" and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, FORECAST["input_schema"])
    # The agent's next turn: the call sent back as the SDK gives it, with its result.
    turn = [{"role": "user", "content": "Forecast for Paris?"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                          "content": [{"type": "text", "text": "Sunny, 18 C"}]}]}]
    answer = claude.messages.create(max_tokens=8, messages=turn, tools=[FORECAST], **T0)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.output_tokens > 0
    # The result reached the prompt: a longer result is more input.
    counted = claude.messages.count_tokens(model="tiny", messages=turn, tools=[FORECAST]).input_tokens
    assert counted == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    turn[-1]["content"][0]["content"][0]["text"] += " with a light breeze from the west"
    longer = claude.messages.count_tokens(model="tiny", messages=turn, tools=[FORECAST]).input_tokens
    assert longer > counted
    turn[-1]["content"][0]["is_error"] = True   # the model is told the call failed
    assert claude.messages.count_tokens(model="tiny", messages=turn, tools=[FORECAST]).input_tokens > longer


def test_a_named_tool_choice_calls_that_tool(claude):
    clock = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
    r = claude.messages.create(max_tokens=200, messages=[{"role": "user", "content": "Forecast?"}],
                               tools=[clock, FORECAST], tool_choice={"type": "tool", "name": "get_forecast"},
                               **T0)
    assert r.stop_reason == "tool_use" and [b.name for b in r.content if b.type == "tool_use"] == ["get_forecast"]


def test_output_config_format_constrains_the_text_to_the_schema(claude):
    schema = {"type": "object", "additionalProperties": False, "required": ["colour"],
              "properties": {"colour": {"enum": ["red", "green", "blue"]}}}
    r = claude.messages.create(max_tokens=60, messages=[{"role": "user", "content": "A colour?"}], **T0,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(r)), schema)
    with pytest.raises(anthropic.BadRequestError) as e:   # a schema the grammar engine refuses
        claude.messages.create(max_tokens=4, messages=ASK, model="tiny",
                               output_config={"format": {"type": "json_schema", "schema": {"type": "nope"}}})
    assert e.value.body["error"]["message"].startswith("Invalid `output_config.format.schema`: ")


def test_count_tokens_is_the_prompt_that_usage_counts_cached_or_not(claude):
    # A system prompt no other test sends: its first block is this test's own, not cached already.
    system = "Count tokens, briefly."
    long = [{"role": "user", "content": "Count these tokens, a prompt of several blocks. " * 6}]
    counted = claude.messages.count_tokens(model="tiny", messages=long, system=system).input_tokens
    first = claude.messages.create(max_tokens=1, messages=long, system=system, **T0).usage
    again = claude.messages.create(max_tokens=1, messages=long, system=system, **T0).usage
    assert first.cache_read_input_tokens == 0 and first.input_tokens == counted
    assert again.cache_read_input_tokens > 0 and again.input_tokens + again.cache_read_input_tokens == counted
    assert claude.messages.count_tokens(model="tiny", messages=long).input_tokens < counted


def test_a_last_assistant_message_is_continued(claude, client):
    turn = ASK + [{"role": "assistant", "content": "I am"}]
    r = claude.messages.create(max_tokens=6, messages=turn, **T0)
    chat = client.chat.completions.create(messages=turn, max_tokens=6, **GREEDY, extra_body={
        "add_generation_prompt": False, "continue_final_message": True}).choices[0]
    assert _text(r) == chat.message.content


@pytest.mark.parametrize("body, param", [
    ({"bogus": 1}, "bogus"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"tools": [{"name": "f g", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [FORECAST]}, "tool_choice"),
])
def test_a_bad_request_is_a_400_in_anthropics_shape(claude, body, param):
    body = dict(body)
    known = {k: body.pop(k) for k in ("max_tokens", "messages", "thinking", "tools", "tool_choice") if k in body}
    with pytest.raises(anthropic.BadRequestError) as e:   # the rest (unknown to the SDK) as extra body
        claude.messages.create(**{"max_tokens": 4, "messages": ASK, **known}, model="tiny", extra_body=body)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert param in e.value.body["error"]["message"]   # the field named, as `param` names it elsewhere


def test_errors_outside_the_handler_take_anthropics_shape_too(tiny_servers):
    missing = {"model": "tiny", "messages": ASK}   # max_tokens is required, as Anthropic's
    r = http.post(tiny_servers.main + "/v1/messages", headers=HEADERS, json_body=missing)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"] and r.json()["request_id"] == r.headers["x-request-id"]
    r = http.post(tiny_servers.main + "/v1/messages", headers=HEADERS, json_body={**missing, "max_tokens": 2, "model": "claude"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.post(tiny_servers.down + "/v1/messages", headers=HEADERS, json_body={**missing, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
    r = http.post(tiny_servers.limits + "/v1/messages/count_tokens", headers=HEADERS,
                  json_body={"messages": [{"role": "user", "content": "x" * 8192}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = http.get(tiny_servers.main + "/v1/messages", headers=HEADERS)
    assert r.status_code == 405 and r.json()["type"] == "error"
    # The other routes keep OpenAI's shape.
    r = http.post(tiny_servers.main + "/v1/chat/completions", headers=HEADERS, json_body={"messages": []})
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "messages"


def test_x_api_key_authenticates_and_a_wrong_key_is_401_in_anthropics_shape(claude, tiny_servers):
    wrong = anthropic.Anthropic(base_url=tiny_servers.main, api_key="wrong-key", max_retries=0)
    for call in (lambda c: c.messages.create(max_tokens=1, messages=ASK, model="tiny"),
                 lambda c: c.messages.count_tokens(messages=ASK, model="tiny")):
        with pytest.raises(anthropic.AuthenticationError) as e:
            call(wrong)
        assert e.value.status_code == 401
        assert e.value.body["error"]["type"] == "authentication_error"
        call(claude)
    bearer = http.post(tiny_servers.main + "/v1/messages/count_tokens", json_body={"messages": ASK},
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0


def test_the_request_id_reaches_the_sdk(claude):
    r = claude.messages.with_raw_response.create(max_tokens=1, messages=ASK, model="tiny",
                                                 extra_headers={"X-Request-Id": "my-id-42"})
    assert r.headers["request-id"] == "my-id-42" and r.parse()._request_id == "my-id-42"


def test_openapi_documents_the_routes_with_anthropics_error(tiny_servers):
    doc = http.get(tiny_servers.main + "/openapi.json").json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        op = doc["paths"][path]["post"]
        assert op["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicError")
        assert {"bearer": []} in op["security"] and {"apiKey": []} in op["security"]
    assert "max_tokens" in doc["components"]["schemas"]["MessagesRequest"]["required"]
    assert doc["components"]["securitySchemes"]["apiKey"] == {"type": "apiKey", "in": "header", "name": "x-api-key"}


def test_a_full_queue_is_a_429_rate_limit_error(tiny_servers):
    from tests.gateway.test_hardening import HoldingProxy, _wait_for, held_count, release

    live = tiny_servers.live
    held = live.run(live.engine.system.spawn(HoldingProxy(live.engine.scheduler), name="messages-holding-proxy"))
    base = live.add_app(GatewayConfig(served_model_name="tiny", max_waiting=1), scheduler=held)
    body = {"model": "tiny", "max_tokens": 2, "messages": ASK}
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(r=http.post(base + "/v1/messages", json_body=body)))
    t.start()
    try:
        _wait_for(lambda: live.run(held_count(held)) == 1)
        with pytest.raises(anthropic.RateLimitError) as e:
            anthropic.Anthropic(base_url=base, api_key="k", max_retries=0).messages.create(**body)
        assert e.value.body["error"]["type"] == "rate_limit_error" and e.value.response.headers["retry-after"]
    finally:
        live.run(release(held))
        t.join(60)
    assert first["r"].status_code == 200 and first["r"].json()["type"] == "message"


def test_an_engine_lost_mid_stream_ends_it_with_an_error_event(tiny_servers):
    live = tiny_servers.live
    proxy = live.spawn_proxy("doomed-messages-scheduler")
    base = live.add_app(GatewayConfig(served_model_name="tiny"), scheduler=proxy)
    body = {"model": "tiny", "max_tokens": 60, "messages": ASK, "stream": True, "temperature": 0}
    conn, resp = http.open_request("POST", base + "/v1/messages", json_body=body)
    try:
        assert resp.status == 200
        while b"content_block_delta" not in resp.readline():
            pass
        live.stop_actor(proxy)   # the engine, as this gateway knows it, is gone
        rest = resp.read().decode()
    finally:
        conn.close()
    names = [ln[7:] for ln in rest.splitlines() if ln.startswith("event: ")]
    assert names[-1] == "error" and "message_delta" not in names and "message_stop" not in names   # no finish
    error = json.loads(rest.strip().splitlines()[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


@pytest.mark.parametrize("source", [
    {"type": "base64", "media_type": "image/png", "data": PNG},
    {"type": "url", "url": "https://example.com/chart.png"},
])
def test_an_image_inside_a_tool_result_is_the_same_clear_400_as_a_top_level_one(claude, source):
    image = {"type": "image", "source": source, "cache_control": {"type": "ephemeral"}}
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_forecast", "input": {"city": "Oslo", "days": 1}}
    turns = [{"role": "user", "content": "Show me the forecast chart."}, {"role": "assistant", "content": [call]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": [{"type": "text", "text": "Chart:"}, image]}]}]
    top = [{"role": "user", "content": [image]}]
    errors = []
    for messages in (turns, top):
        for send in (claude.messages.create, claude.messages.count_tokens):
            kw = {"max_tokens": 4} if send == claude.messages.create else {}
            with pytest.raises(anthropic.BadRequestError) as e:
                send(model="tiny", messages=messages, tools=[FORECAST], **kw)
            errors.append(e.value.body["error"]["message"])
    assert errors[0] == errors[1] and "messages[2].content[0].content[1]" in errors[0]
    assert errors[2] == errors[3] and "messages[0].content[0]" in errors[2]
    assert all(m.endswith(": Image blocks are not supported: only text models are served.") for m in errors)


@pytest.mark.parametrize("block, says", [
    ({"type": "search_result", "source": "https://example.com", "title": "Oslo",
      "content": [{"type": "text", "text": "Cold."}]}, "Search result blocks are not supported"),
    ({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Cold."}},
     "Document blocks are not supported"),
    ({"type": "tool_reference", "tool_name": "get_forecast"}, "Tool reference blocks are not supported"),
])
def test_other_blocks_inside_a_tool_result_are_clear_400s_naming_them(claude, block, says):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_forecast", "input": {"city": "Oslo", "days": 1}}
    turns = [{"role": "user", "content": "Forecast?"}, {"role": "assistant", "content": [call]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [block]}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", max_tokens=4, messages=turns, tools=[FORECAST])
    assert e.value.body["error"]["message"].startswith(f"messages[2].content[0].content[0]: {says}")


def test_server_tool_blocks_in_a_message_are_clear_400s(claude):
    used = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "Oslo"}}
    turns = [{"role": "user", "content": "Search."}, {"role": "assistant", "content": [used]},
             {"role": "user", "content": "And?"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", max_tokens=4, messages=turns)
    assert e.value.body["error"]["message"].startswith("messages[1].content[0]: Server tool blocks are not supported")
