"""Tool-call parsers: whole outputs and streamed text, for the Hermes and Llama 3 JSON formats."""
import json

import pytest

from gateway.tool_parsers import HermesParser, Llama3JsonParser, ToolCallStream

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_whole():
    content, calls = HermesParser().parse(HERMES)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("chatcmpl-tool-")
    assert HermesParser().parse("no calls <tool_call> here") == ("no calls <tool_call> here", [])
    assert HermesParser().parse("<tool_call>{not json}</tool_call>")[1] == []


def test_llama3_json_whole():
    content, calls = Llama3JsonParser().parse(
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}')
    assert content is None and _calls(calls) == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert Llama3JsonParser().parse("Paris is sunny.") == ("Paris is sunny.", [])
    assert Llama3JsonParser().parse('{"name": "a", "parameters": {}} and more')[1] == []


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_streamed_in_any_pieces(size):
    stream, content = ToolCallStream(HermesParser()), ""
    for i in range(0, len(HERMES), size):
        out = stream.push(HERMES[i:i + size])
        assert "<" not in out   # no piece of a tag is ever sent as content
        content += out
    content += stream.finish()
    assert content == "Let me check."
    assert _calls(stream.calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_streamed_text_that_only_looks_like_a_call_is_content():
    stream = ToolCallStream(HermesParser())
    text = "a <tool bag> and <tool_call>oops"
    out = "".join(stream.push(ch) for ch in text) + stream.finish()
    assert out == text and stream.calls == []
    stream = ToolCallStream(Llama3JsonParser())
    out = "".join(stream.push(ch) for ch in "  {not a call") + stream.finish()
    assert out == "  {not a call" and stream.calls == []
    stream = ToolCallStream(Llama3JsonParser())
    assert stream.push("Sunny") == "Sunny" and stream.finish() == ""
