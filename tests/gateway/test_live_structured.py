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
