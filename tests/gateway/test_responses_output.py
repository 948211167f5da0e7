"""ResponseBuilder on hand-made chat chunks: which output items a reply makes, whole and streamed."""
from gateway.responses_output import ResponseBuilder

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 2}}
CALL = {"index": 0, "id": "call-1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def chunk(text: str = "", finish: str | None = None, calls: list | None = None) -> dict:
    delta = {"content": text} if text else {}
    if calls:
        delta["tool_calls"] = calls
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def run(*chunks: dict):
    b = ResponseBuilder({"model": "m"})
    events = b.start()
    for c in chunks:
        events += b.feed(c)
    closing, body = b.finish(USAGE)
    return [name for name, _ in events + closing], body, events + closing


def test_blank_text_before_a_call_makes_no_message():
    names, body, _ = run(chunk("\n"), chunk(" "), chunk(finish="tool_calls", calls=[CALL]))
    assert [item["type"] for item in body["output"]] == ["function_call"]
    assert body["output"][0]["call_id"] == "call-1" and body["output"][0]["arguments"] == '{"a": 1}'
    assert "response.output_text.delta" not in names and names[-1] == "response.completed"


def test_text_and_a_call_make_a_message_then_the_call():
    names, body, _ = run(chunk("\n"), chunk("Let me look."), chunk(finish="tool_calls", calls=[CALL]))
    assert [item["type"] for item in body["output"]] == ["message", "function_call"]
    assert body["output"][0]["content"][0]["text"] == "\nLet me look."   # the blank is kept once text comes
    assert names.index("response.output_item.done") < names.index("response.function_call_arguments.delta")


def test_a_blank_or_empty_reply_is_still_a_message():
    for chunks in ((chunk(" ", finish="stop"),), (chunk(finish="stop"),)):
        names, body, events = run(*chunks)
        text = chunks[0]["choices"][0]["delta"].get("content", "")
        assert [item["type"] for item in body["output"]] == ["message"]
        assert body["output"][0]["content"][0]["text"] == text
        assert "".join(e["delta"] for n, e in events if n == "response.output_text.delta") == text


def test_a_length_finish_is_incomplete_and_usage_is_renamed():
    names, body, events = run(chunk("ab"), chunk("c", finish="length"))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and names[-1] == "response.incomplete"
    assert body["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
