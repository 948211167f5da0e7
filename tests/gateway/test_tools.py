"""What a chat request says about its participants and tools reaches the model as it said it: a
message's `name` through the chat template, and a `strict` function's schema enforced on calls the
model chooses to make (tool_choice auto), over real HTTP and against the grammar itself."""
import json

import pytest
import xgrammar as xgr

from actors.text.grammar import grammar_of
from gateway import protocol
from gateway.config import GatewayConfig
from gateway.tools import chat_tools
from tests.gateway import http_util as http

NAMED = "{% for m in messages %}[{{ m['role'] }}{% if m['name'] %}:{{ m['name'] }}{% endif %}]{{ m['content'] }}" \
        "{% endfor %}[assistant]"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
LOOSE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


def test_a_messages_name_reaches_the_chat_template(tiny_servers):
    base = tiny_servers.live.add_app(GatewayConfig(chat_template=NAMED, served_model_name="tiny"))
    messages = [{"role": "user", "name": "ada", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    tokens = http.post(base + "/tokenize", json_body={"messages": messages}).json()["tokens"]
    assert tokens == tiny_servers.tokenizer.encode("[user:ada]Hi[assistant]Hello[user]Bye[assistant]",
                                                   add_special_tokens=False)
    r = http.post(base + "/v1/chat/completions", json_body={"model": "tiny", "messages": messages, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokens)


def _constraint(tools: list[dict], parser: str = "hermes", **fields):
    req = protocol.decode(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                      **fields}).encode(), protocol.ChatRequest)
    found = chat_tools(req, parser)
    return None if found.forced is None else grammar_of(found.forced)


def _accepts(grammar, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(grammar, text)


def test_without_strict_auto_constrains_nothing():
    assert _constraint([LOOSE]) is None
    assert _constraint([{**WEATHER, "function": {**WEATHER["function"], "strict": False}}]) is None


def test_a_strict_function_under_auto_holds_the_calls_the_model_makes_to_its_schema():
    g = _constraint([WEATHER, LOOSE])
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    assert _accepts(g, "It is sunny in Paris today.")                               # free text stays free
    assert _accepts(g, "Let me look. " + call.format("get_weather", '{"city": "Paris"}'))
    assert not _accepts(g, call.format("get_weather", '{"city": 3}'))              # the strict schema
    assert not _accepts(g, call.format("get_weather", '{"town": "Paris"}'))
    assert not _accepts(g, call.format("get_time", "{}"))                          # no such function
    assert _accepts(g, call.format("note", '{"anything": [1]}'))                   # not strict: any object
    assert not _accepts(g, call.format("note", '"text"'))
    llama = _constraint([WEATHER], "llama3_json")
    assert _accepts(llama, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert not _accepts(llama, '{"name": "get_weather", "parameters": {"city": null}}')


@pytest.fixture(scope="module")
def tool_server(tiny_servers):
    return tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny"))


def test_a_strict_function_under_auto_is_served_and_counts_as_the_requests_constraint(tool_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 8,
            "tools": [WEATHER]}
    r = http.post(tool_server + "/v1/chat/completions", json_body=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    for call in choice["message"].get("tool_calls") or []:
        assert call["function"]["name"] == "get_weather" and isinstance(json.loads(call["function"]["arguments"])["city"], str)
    r = http.post(tool_server + "/v1/chat/completions", json_body={**body, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    loose = {**body, "tools": [LOOSE], "response_format": {"type": "json_object"}}
    assert http.post(tool_server + "/v1/chat/completions", json_body=loose).status_code == 200
