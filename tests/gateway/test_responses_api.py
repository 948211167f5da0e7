"""/v1/responses over real HTTP with the `openai` SDK unchanged, on the tiny random-weight model.

The text is gibberish, so each test checks what the translation must preserve: the same greedy
text and prompt tokens as the equivalent chat completion, the event sequence of a stream, calls
and JSON that validate, the stored conversation that `previous_response_id` continues.
"""
import json

import jsonschema
import openai
import pytest

from gateway.config import GatewayConfig
from gateway.responses_api import RESPONSE_STORE
from tests.gateway import http_util as http
from tests.gateway.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = dict(model="tiny", temperature=0)
WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                 "unit": {"enum": ["celsius", "fahrenheit"]}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": WEATHER_PARAMS, "strict": True}


def chat(client, messages, **kw):
    return client.chat.completions.create(messages=messages, **GREEDY, **kw)


def events_of(stream) -> list:
    return list(stream)


def test_a_string_input_is_a_user_message(client):
    r = client.responses.create(input="Hello world", max_output_tokens=12, **GREEDY)
    c = chat(client, [{"role": "user", "content": "Hello world"}], max_tokens=12)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")


def test_items_and_instructions_render_as_the_chat_conversation(client):
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello there"}]},
             {"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name "}, {"type": "input_text", "text": "a fruit"}]}]
    r = client.responses.create(input=items, instructions="Be brief.", max_output_tokens=10, **GREEDY)
    c = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello there"}, {"role": "system", "content": "Answer in one word."},
                      {"role": "user", "content": "Name a fruit"}], max_tokens=10)
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == c.choices[0].message.content
    assert r.instructions == "Be brief."
    without = client.responses.create(input=items, max_output_tokens=1, **GREEDY)
    assert without.usage.input_tokens < r.usage.input_tokens


def test_a_stream_sends_the_event_sequence_and_its_deltas_make_the_text(client, tiny_servers):
    kw = dict(input="The quick brown fox", max_output_tokens=12, **GREEDY)
    whole = client.responses.create(**kw)
    events = events_of(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == whole.output_text == events[-1].response.output_text
    assert events[-2].item.content[0].text == deltas and events[-4].text == deltas
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    # On the wire: each `data:` after an `event:` line naming its type, and no [DONE].
    conn, resp = http.open_request("POST", tiny_servers.main + "/v1/responses", headers=AUTH,
                                   json_body={**kw, "stream": True})
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    assert "[DONE]" not in raw and len(blocks) == len(events)
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and json.loads(data.removeprefix("data: "))["type"] == name[7:]


def test_max_output_tokens_cut_makes_an_incomplete_response(client):
    c = chat(client, [{"role": "user", "content": "Count to ten"}], max_tokens=3)
    assert c.choices[0].finish_reason == "length"   # this prompt runs on past 3 tokens
    r = client.responses.create(input="Count to ten", max_output_tokens=3, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    assert r.output_text == c.choices[0].message.content and r.max_output_tokens == 3
    events = events_of(client.responses.create(input="Count to ten", max_output_tokens=3, stream=True, **GREEDY))
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == "max_output_tokens"


def _call(r):
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1, r.output
    return calls[0]


OSLO = [{"role": "user", "content": "Weather in Oslo?"}]


def _answered_call(client):
    """A forced weather call (not stored), and the input that answers it: the question, the output items as
    returned, the call's output."""
    r = client.responses.create(input=OSLO, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=256, store=False, **GREEDY)
    call = _call(r)
    return call, OSLO + r.output + [{"type": "function_call_output", "call_id": call.call_id, "output": "cold"}]


def test_a_required_tool_call_validates_and_its_output_continues_the_conversation(client):
    ask = "What is the weather in Paris?"
    r = client.responses.create(input=ask, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=256, **GREEDY)
    call = _call(r)
    assert r.status == "completed" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER_PARAMS)
    assert r.tool_choice == "required" and r.tools[0].name == "get_weather"

    follow = client.responses.create(previous_response_id=r.id, tools=[WEATHER], max_output_tokens=8, **GREEDY,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 C, sunny"}])
    assert follow.previous_response_id == r.id
    same = chat(client, [{"role": "user", "content": ask},
                         {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                                               "function": {"name": call.name,
                                                                            "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}],
                tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS,
                                                         "strict": True}}],
                max_tokens=8)
    assert follow.usage.input_tokens == same.usage.prompt_tokens
    assert follow.output_text == (same.choices[0].message.content or "")


def test_a_named_tool_call_streams_its_arguments(client):
    events = events_of(client.responses.create(input="Weather in Rome?", tools=[WEATHER], max_output_tokens=256,
                                               tool_choice={"type": "function", "name": "get_weather"},
                                               stream=True, **GREEDY))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.status == "in_progress"
    done = events[5].item
    assert events[3].delta == events[4].arguments == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER_PARAMS)
    assert _call(events[-1].response).call_id == done.call_id


def test_a_function_call_output_must_answer_a_call(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}], model="tiny")
    assert e.value.body["param"] == "input[0].call_id"
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "cold"}]
    r = client.responses.create(input=items, max_output_tokens=4, **GREEDY)
    c = chat(client, [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                          "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "cold"}], max_tokens=4)
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.output_text == c.choices[0].message.content


PET = {"type": "object", "additionalProperties": False, "required": ["kind", "friendly"],
       "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "friendly": {"type": "boolean"}}}


def test_a_json_schema_text_format_parses_and_validates(client):
    for seed_temperature in (0.0, 1.0):
        r = client.responses.create(input="Describe a pet.", model="tiny", temperature=seed_temperature,
                                    max_output_tokens=64,
                                    text={"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), PET)
        assert r.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="x", model="tiny", text={"format": {
            "type": "json_schema", "name": "bad", "schema": {"type": "no-such-type"}}})
    assert e.value.body["param"] == "text.format.schema" and "no-such-type" in e.value.body["message"]


def test_previous_response_id_continues_without_the_old_instructions(client):
    first = client.responses.create(input="Hello world", instructions="Be brief.", max_output_tokens=6, **GREEDY)
    second = client.responses.create(input="And then?", previous_response_id=first.id, max_output_tokens=6, **GREEDY)
    c = chat(client, [{"role": "user", "content": "Hello world"},
                      {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "And then?"}], max_tokens=6)
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.output_text == c.choices[0].message.content
    assert second.instructions is None and second.previous_response_id == first.id


def test_retrieve_and_delete(client):
    r = client.responses.create(input="Hello", max_output_tokens=4, metadata={"job": "42"}, **GREEDY)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"job": "42"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="More", previous_response_id=r.id, model="tiny")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    unstored = client.responses.create(input="Hello", max_output_tokens=2, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def small_store(tiny_servers):
    """A gateway whose store keeps two responses for 60 s of a clock the test moves."""
    live = tiny_servers.live
    base = live.add_app(GatewayConfig(served_model_name="tiny", response_store_entries=2, response_store_ttl_s=60))
    clock = Clock()
    live.runners[-1].app[RESPONSE_STORE].clock = clock
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120), clock


def test_evicted_and_expired_responses_are_404s(small_store):
    client, clock = small_store
    a, b = (client.responses.create(input=t, max_output_tokens=2, **GREEDY) for t in ("one", "two"))
    client.responses.retrieve(a.id)    # a is now used more recently than b
    c = client.responses.create(input="three", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="go on", previous_response_id=b.id, **GREEDY)
    assert e.value.status_code == 404 and e.value.body["code"] == "previous_response_not_found"
    assert e.value.body["param"] == "previous_response_id" and b.id in e.value.body["message"]
    assert client.responses.retrieve(a.id).id == a.id and client.responses.retrieve(c.id).id == c.id
    clock.now += 61
    for gone in (a, c):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="go on", previous_response_id=c.id, **GREEDY)


def test_a_stored_response_is_reachable_only_with_the_token_that_made_it(small_store):
    client, _ = small_store   # a server without keys: each bearer token is still its own tenant
    other = client.with_options(api_key="another-tenant")
    r = client.responses.create(input="secret plans", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(input="go on", previous_response_id=r.id, **GREEDY)
    assert e.value.body["code"] == "previous_response_not_found"
    assert client.responses.retrieve(r.id).id == r.id


EFFORT_TEMPLATE = ("{% if reasoning_effort is defined %}(effort {{ reasoning_effort }}){% endif %}"
                   "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_reasoning_effort_reaches_the_chat_template_as_chat_sends_it(tiny_servers):
    base = tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny", chat_template=EFFORT_TEMPLATE))
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    plain = client.responses.create(input="Hi", max_output_tokens=1, **GREEDY)
    effort = client.responses.create(input="Hi", max_output_tokens=1, reasoning={"effort": "high"}, **GREEDY)
    c = chat(client, [{"role": "user", "content": "Hi"}], max_tokens=1, reasoning_effort="high")
    assert effort.usage.input_tokens == c.usage.prompt_tokens > plain.usage.input_tokens
    assert effort.reasoning.effort == "high"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, "include[1]"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "top_logprobs": -1}, "top_logprobs"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].summary"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10 ** 6}, "input"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{**WEATHER, "type": "custom"}]}, "tools[0].type"),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "model": "gpt-5"}, "model"),
])
def test_bad_requests_are_400s_naming_the_field(tiny_servers, body, param):
    r = http.post(tiny_servers.main + "/v1/responses", headers=AUTH, json_body={"model": "tiny", **body})
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_route_has_the_other_routes_key_and_request_id(tiny_servers):
    body = {"input": "Hi", "model": "tiny", "max_output_tokens": 2}
    assert http.post(tiny_servers.main + "/v1/responses", json_body=body).status_code == 401
    r = http.post(tiny_servers.main + "/v1/responses", headers={**AUTH, "X-Request-Id": "resp-test-1"}, json_body=body)
    assert r.status_code == 200 and r.headers["x-request-id"] == "resp-test-1"
    assert http.get(tiny_servers.main + "/v1/responses/" + r.json()["id"]).status_code == 401
    assert http.get(tiny_servers.main + "/v1/responses/resp_nope", headers=AUTH).json()["error"]["param"] == "response_id"


def test_output_items_sent_back_as_input_continue_without_the_store(client):
    """The SDK's stateless way: the previous output items, as returned, in the next input."""
    call, items = _answered_call(client)
    stateless = client.responses.create(input=items, tools=[WEATHER], max_output_tokens=4, store=False, **GREEDY)
    stored = client.responses.create(input=OSLO, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                     max_output_tokens=256, **GREEDY)
    assert _call(stored).arguments == call.arguments   # greedy: the same call
    chained = client.responses.create(previous_response_id=stored.id, tools=[WEATHER], max_output_tokens=4, **GREEDY,
                                      input=[{"type": "function_call_output", "call_id": _call(stored).call_id,
                                              "output": "cold"}])
    assert stateless.usage.input_tokens == chained.usage.input_tokens
    texts = client.responses.create(input="Hello world", max_output_tokens=4, store=False, **GREEDY)
    again = client.responses.create(input=[{"role": "user", "content": "Hello world"}] + texts.output
                                    + [{"role": "user", "content": "More"}], max_output_tokens=2, **GREEDY)
    c = chat(client, [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": texts.output_text},
                      {"role": "user", "content": "More"}], max_tokens=2)
    assert again.usage.input_tokens == c.usage.prompt_tokens and again.output_text == c.choices[0].message.content


def test_an_engine_lost_mid_stream_fails_the_response_and_stores_nothing(tiny_servers):
    live = tiny_servers.live
    proxy = live.spawn_proxy("doomed-responses-scheduler")
    base = live.add_app(GatewayConfig(served_model_name="tiny"), scheduler=proxy)
    body = {"model": "tiny", "input": "Count to ten", "max_output_tokens": 200, "temperature": 0, "stream": True}
    conn, resp = http.open_request("POST", base + "/v1/responses", json_body=body)
    try:
        assert resp.status == 200
        seen = []
        while "response.output_text.delta" not in seen:
            line = resp.readline()
            assert line, "the stream ended before any text"
            if line.startswith(b"data: "):
                seen.append(json.loads(line[6:])["type"])
        live.stop_actor(proxy)
        rest = resp.read().decode()
    finally:
        conn.close()
    events = [json.loads(ln[6:]) for ln in rest.splitlines() if ln.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"] and "[DONE]" not in rest
    assert events[-2]["code"] == "service_unavailable" and events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "service_unavailable"
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
    r = http.get(base + "/v1/responses/" + failed["id"])
    assert r.status_code == 404


def test_a_client_that_hangs_up_mid_stream_frees_its_kv_blocks(client, tiny_servers):
    from tests.gateway.test_live_api import assert_all_freed, metric

    base, ask = tiny_servers.main, "Count to ten. " * 8
    assert chat(client, [{"role": "user", "content": ask}], max_tokens=600).choices[0].finish_reason == "length"
    free_before = metric(base, "matinee_kv_blocks_free")
    conn, resp = http.open_request("POST", base + "/v1/responses", headers=AUTH, json_body={
        "model": "tiny", "input": ask, "max_output_tokens": 600, "temperature": 0, "stream": True})
    assert resp.status == 200
    seen = 0
    while seen < 5:
        line = resp.readline()
        assert line, "the stream ended early"
        seen += line.startswith(b"data: ")
    assert metric(base, "matinee_kv_blocks_free") < free_before
    conn.close()
    assert_all_freed(base, free_before)


def test_the_route_has_the_other_routes_limits_and_pings(tiny_servers):
    limits = tiny_servers.limits   # 4 KiB bodies, a ping after 5 ms of silence
    r = http.post(limits + "/v1/responses", json_body={"model": "tiny", "input": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    def body(first: str) -> dict:   # a long prompt, new to the prefix cache: its prefill takes a while
        return {"model": "tiny", "input": first + " Count to ten." * 110, "max_output_tokens": 8,
                "temperature": 0, "stream": True}

    raw = http.post(limits + "/v1/responses", json_body=body("One")).text
    assert ": ping\n\n" in raw and raw.rstrip().endswith("}")
    sdk = openai.OpenAI(base_url=limits + "/v1", api_key="unused", max_retries=0, timeout=120)
    events = events_of(sdk.responses.create(**body("Two")))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 8


def test_input_items_list_the_requests_own_items_with_ids_and_pages(client):
    first = client.responses.create(input="Hello world", instructions="Be brief.", max_output_tokens=2, **GREEDY)
    items = client.responses.input_items.list(first.id)
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in items.data] == \
        [("message", "user", "input_text", "Hello world")]
    assert items.data[0].id.startswith("msg_") and items.first_id == items.last_id == items.data[0].id
    assert items.has_more is False
    sent = [{"role": "user", "content": "one"}, {"role": "developer", "content": [{"type": "input_text", "text": "two"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "three"}],
             "id": "msg_sent_back"},
            {"role": "user", "content": "four"}, {"role": "user", "content": "five"}]
    r = client.responses.create(input=sent, previous_response_id=first.id, max_output_tokens=2, **GREEDY)
    texts = ["one", "two", "three", "four", "five"]
    whole = client.responses.input_items.list(r.id, order="asc")   # not the history, only this request's input
    assert [i.content[0].text for i in whole.data] == texts and whole.has_more is False
    assert [i.role for i in whole.data] == ["user", "developer", "assistant", "user", "user"]
    assert whole.data[2].id == "msg_sent_back" and whole.data[2].content[0].type == "output_text"
    assert len({i.id for i in whole.data}) == 5
    ids = [i.id for i in whole.data]
    newest = client.responses.input_items.list(r.id)   # desc by default
    assert [i.id for i in newest.data] == ids[::-1]
    page = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.id for i in page.data] == ids[:2] and page.has_more and page.last_id == ids[1]
    assert [i.id for i in client.responses.input_items.list(r.id, order="asc", limit=2)] == ids   # the SDK follows `after`
    assert [i.id for i in client.responses.input_items.list(r.id, limit=2)] == ids[::-1]
    after = client.responses.input_items.list(r.id, order="asc", limit=2, after=ids[3])
    assert [i.id for i in after.data] == ids[4:] and after.has_more is False
    before = client.responses.input_items.list(r.id, order="asc", limit=2, extra_query={"before": ids[3]})
    assert [i.id for i in before.data] == ids[1:3] and before.has_more is True
    desc_before = client.responses.input_items.list(r.id, limit=10, extra_query={"before": ids[1]})
    assert [i.id for i in desc_before.data] == ids[:1:-1] and desc_before.has_more is False


def test_input_items_of_tool_calls_and_their_outputs(client):
    call, sent = _answered_call(client)
    after = client.responses.create(input=sent, tools=[WEATHER], max_output_tokens=2, **GREEDY)
    items = client.responses.input_items.list(after.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1].id == call.id and items[1].call_id == call.call_id and items[1].arguments == call.arguments
    assert items[1].name == "get_weather"
    assert items[2].call_id == call.call_id and items[2].output == "cold" and items[2].id.startswith("fco_")


def test_input_items_are_404_for_unknown_deleted_and_other_keys_responses(client, small_store):
    other_client, _ = small_store   # a server without keys: each bearer token is still its own tenant
    r = client.responses.create(input="Hello", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.input_items.list("resp_nope")
    assert e.value.body["param"] == "response_id"
    mine = other_client.responses.create(input="Hello", max_output_tokens=2, **GREEDY)
    assert len(other_client.responses.input_items.list(mine.id).data) == 1
    with pytest.raises(openai.NotFoundError):
        other_client.with_options(api_key="another-tenant").responses.input_items.list(mine.id)
    unstored = client.responses.create(input="Hello", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(unstored.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(r.id)


@pytest.mark.parametrize("query, param", [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
    ({"after": "msg_nope"}, "after"), ({"before": "msg_nope"}, "before"), ({"colour": "red"}, "colour"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
])
def test_input_items_bad_queries_are_400s_naming_the_parameter(client, query, param):
    r = client.responses.create(input="Hello", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(r.id, extra_query=query)
    assert e.value.body["param"] == param


LOGPROBS = ["message.output_text.logprobs"]


def test_logprobs_are_the_chat_completions_and_top_logprobs_its_alternatives(client):
    kw = dict(input="The quick brown fox", max_output_tokens=8, **GREEDY)
    r = client.responses.create(**kw, include=LOGPROBS, top_logprobs=3)
    c = chat(client, [{"role": "user", "content": "The quick brown fox"}], max_tokens=8, logprobs=True, top_logprobs=3)
    want = c.choices[0].logprobs.content
    got = r.output[0].content[0].logprobs
    assert r.top_logprobs == 3 and len(got) == len(want) == r.usage.output_tokens
    for g, w in zip(got, want):
        assert (g.token, g.bytes, g.logprob) == (w.token, w.bytes, w.logprob)
        assert [(t.token, t.logprob) for t in g.top_logprobs] == [(t.token, t.logprob) for t in w.top_logprobs]
        assert len(g.top_logprobs) == 3 and g.top_logprobs[0].logprob >= g.top_logprobs[-1].logprob
    bare = client.responses.create(**kw, include=LOGPROBS)   # no alternatives unless asked
    assert [lp.logprob for lp in bare.output[0].content[0].logprobs] == [lp.logprob for lp in got]
    assert all(lp.top_logprobs == [] for lp in bare.output[0].content[0].logprobs)
    alone = client.responses.create(**kw, top_logprobs=3)   # top_logprobs alone adds none, as OpenAI's API
    assert alone.output[0].content[0].logprobs == [] and alone.top_logprobs == 3
    assert client.responses.retrieve(r.id).output[0].content[0].logprobs == got


def test_streamed_logprobs_ride_on_the_deltas_and_add_up_to_the_whole(client):
    kw = dict(input="The quick brown fox", max_output_tokens=8, include=LOGPROBS, top_logprobs=2, **GREEDY)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp for d in deltas for lp in d.logprobs]
    want = whole.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in want]
    assert [[t.token for t in lp.top_logprobs] for lp in streamed] == [[t.token for t in lp.top_logprobs] for lp in want]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.logprob for lp in done.logprobs] == [lp.logprob for lp in want]
    assert events[-1].response.output[0].content[0].logprobs == want
    plain = list(client.responses.create(input="The quick brown fox", max_output_tokens=8, stream=True, **GREEDY))
    assert all(e.logprobs == [] for e in plain if e.type == "response.output_text.delta")


def test_vllm_sampling_fields_reach_the_sampler_as_on_chat(client):
    extra = {"top_k": 4, "min_p": 0.05, "seed": 7, "repetition_penalty": 1.3, "presence_penalty": 0.5,
             "frequency_penalty": 0.2, "ignore_eos": True, "stop_token_ids": [2], "skip_special_tokens": True,
             "include_stop_str_in_output": False, "cache_salt": "salt", "priority": 0}
    r = client.responses.create(model="tiny", input="Hello world", max_output_tokens=10, temperature=1.0,
                                extra_body=extra)
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello world"}],
                                       max_tokens=10, temperature=1.0, extra_body=extra)
    assert r.output_text == c.choices[0].message.content and r.usage.output_tokens == 10
    loose = client.responses.create(model="tiny", input="Hello world", max_output_tokens=10, temperature=1.0,
                                    extra_body={**extra, "top_k": 0, "min_p": 0.0, "seed": 8})
    assert loose.output_text != r.output_text   # the fields change what is sampled
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", extra_body={"top_k": -5})
    assert e.value.body["param"] == "top_k"
