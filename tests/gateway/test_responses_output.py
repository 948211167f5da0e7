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


def _lp(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": token, "logprob": logprob, "bytes": list(token.encode())}]}


def test_a_held_back_tokens_logprob_rides_on_the_delta_that_shows_its_text():
    b = ResponseBuilder({"model": "m"}, logprobs=True)
    events = b.start()
    for text, lps in (("\n", [_lp("\n", -0.5)]), ("", [_lp("He", -1.0)]), ("Hello", [_lp("llo", -2.0)])):
        c = chunk(text)
        c["choices"][0]["logprobs"] = {"content": lps}
        events += b.feed(c)
    closing, body = b.finish(USAGE)
    deltas = [e for name, e in events + closing if name == "response.output_text.delta"]
    assert [d["delta"] for d in deltas] == ["\nHello"]   # the blank waits for text, its logprob with it
    assert [lp["token"] for lp in deltas[0]["logprobs"]] == ["\n", "He", "llo"]
    assert deltas[0]["logprobs"][1] == {"token": "He", "logprob": -1.0, "top_logprobs": [{"token": "He", "logprob": -1.0}]}
    part = body["output"][0]["content"][0]
    assert [lp["token"] for lp in part["logprobs"]] == ["\n", "He", "llo"] and part["logprobs"][2]["bytes"] == [108, 108, 111]


def test_without_logprobs_asked_the_chunks_logprobs_are_left_out():
    b = ResponseBuilder({"model": "m"})
    c = chunk("Hi", finish="stop")
    c["choices"][0]["logprobs"] = {"content": [_lp("Hi", -1.0)]}
    events = b.feed(c)
    _, body = b.finish(USAGE)
    assert events[-1][1]["logprobs"] == [] and body["output"][0]["content"][0]["logprobs"] == []
