"""Structured outputs on the default model through the openai client: what comes back always
parses and validates, sampled at temperature 1, whole and streamed; a bad grammar is a 400."""
import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "verified": {"type": "boolean"}},
            "required": ["city", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a pet as JSON."}]
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}


@pytest.fixture(scope="module")
def smol(smol_server):
    return openai.OpenAI(base_url=smol_server + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_json_schema_holds_on_every_sample(smol):
    texts = []
    for _ in range(2):
        r = smol.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, n=10, max_tokens=160,
                                         response_format=PET_FORMAT)
        assert [c.finish_reason for c in r.choices] == ["stop"] * 10
        texts += [c.message.content for c in r.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), PET)
    assert len(set(texts)) > 1   # sampled, not one forced answer


def test_json_schema_holds_streamed(smol):
    parts, finish = ["", ""], [None, None]
    for chunk in smol.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, n=2, max_tokens=160,
                                              response_format=PET_FORMAT, stream=True):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert finish == ["stop", "stop"]
    for text in parts:
        jsonschema.validate(json.loads(text), PET)


def test_json_object_parses(smol):
    r = smol.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}],
                                     temperature=0.8, max_tokens=200, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:   # cut by max_tokens: still a prefix of an object
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_regex_and_choice_hold_on_completions(smol):
    r = smol.completions.create(model=MODEL, prompt="The phone number is", temperature=1.0, n=4, max_tokens=20,
                                extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    for c in r.choices:
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.text) and c.finish_reason == "stop"
    r = smol.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                     temperature=1.0, n=4, max_tokens=10,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}})
    assert all(c.message.content in ("yes", "no", "maybe so") for c in r.choices)


def test_a_bad_schema_is_a_400_naming_it(smol):
    with pytest.raises(openai.BadRequestError) as e:
        smol.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert "no-such-type" in e.value.message and e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        smol.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "[a-z"})
    assert e.value.body["param"] == "guided_regex"
    # The engine was never asked: it still answers.
    ok = smol.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _streamed_calls(chunks) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += tc.id or ""
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(smol, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, tools=[WEATHER, CLOCK], temperature=1.0, max_tokens=100)
    # One call: a model this small, free to go on calling, may call until max_tokens.
    first = smol.chat.completions.create(messages=messages, tool_choice="required", parallel_tool_calls=False,
                                         stream=stream, **kw)
    if stream:
        _, calls, finish = _streamed_calls(first)
    else:
        finish = first.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in first.choices[0].message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1
    for call in calls:
        assert call["name"] in ("get_weather", "get_time") and call["id"]
        schema = (WEATHER if call["name"] == "get_weather" else CLOCK)["function"]["parameters"]
        jsonschema.validate(json.loads(call["arguments"]), schema)
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]})
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": "18 C and sunny"} for c in calls]
    final = smol.chat.completions.create(messages=messages, stream=stream, **{**kw, "max_tokens": 24})
    if stream:
        content, calls, finish = _streamed_calls(final)
    else:
        content, calls, finish = final.choices[0].message.content, final.choices[0].message.tool_calls, \
            final.choices[0].finish_reason
    assert content and not calls and finish in ("stop", "length")


def test_a_named_tool_choice_makes_one_call_to_it(smol):
    r = smol.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                     tools=[WEATHER, CLOCK], max_tokens=100, temperature=1.0,
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
