"""A Responses body translated into the chat request that generates it."""
import msgspec
import pytest

from gateway import protocol
from gateway.errors import APIError
from gateway.responses_protocol import ResponsesRequest, chat_request, input_messages, validate


def request(**body) -> ResponsesRequest:
    req = protocol.decode(msgspec.json.encode(body), ResponsesRequest)
    validate(req)
    return req


def test_an_assistant_turn_keeps_its_text_and_its_calls_in_one_message():
    req = request(input=[
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "a", "name": "w", "arguments": '{"city": "Oslo"}', "id": "fc_1"},
        {"type": "function_call", "call_id": "b", "name": "w", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "a", "output": "cold"},
        {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "warm"}]}])
    msgs = input_messages(req, [])
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert msgs[1].content == "Checking." and [c.id for c in msgs[1].tool_calls] == ["a", "b"]
    assert msgs[1].tool_calls[1].function.arguments == '{"city": "Rome"}'
    assert (msgs[2].tool_call_id, msgs[2].content, msgs[3].content) == ("a", "cold", "warm")


def test_a_call_output_may_answer_a_call_of_the_previous_response():
    history = [protocol.ChatMessage(role="assistant", tool_calls=[
        protocol.ToolCall(function=protocol.FunctionCall("w", "{}"), id="old")])]
    req = request(input=[{"type": "function_call_output", "call_id": "old", "output": "ok"}])
    assert input_messages(req, history)[0].tool_call_id == "old"
    with pytest.raises(APIError) as e:
        input_messages(req, [])
    assert e.value.param == "input[0].call_id"


def test_the_chat_request_carries_instructions_first_and_the_settings():
    req = request(input="Hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9,
                  tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}, "strict": True}],
                  tool_choice={"type": "function", "name": "w"}, parallel_tool_calls=False,
                  text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
                  reasoning={"effort": "low"}, user="u")
    chat = chat_request(req, input_messages(req, []))
    protocol.validate_chat(chat)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p) == (7, 0.5, 0.9)
    assert chat.tools[0].function.name == "w" and chat.tools[0].function.strict is True
    assert chat.tool_choice.function.name == "w" and chat.parallel_tool_calls is False
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema == {"type": "object"}
    assert chat.reasoning_effort == "low" and chat.user == "u"
    plain = chat_request(request(input="Hi"), [])
    assert plain.response_format is None and plain.tools is None and plain.messages == []
