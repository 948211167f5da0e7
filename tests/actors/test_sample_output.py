"""The one output processor of the gateway and the offline LLM: a sample's text and how it ended."""

from __future__ import annotations

from actors.messages.front_end import TokenDelta
from actors.text.sample_output import SampleOutput


class Letters:
    """A tokenizer whose token i is the letter chr(ord('a') + i); 99 is a special token."""

    def __init__(self) -> None:
        self.decodes = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return "".join("<s>" if i == 99 and not skip_special_tokens else "" if i == 99 else chr(97 + i) for i in ids)


def delta(ids, finish=None, error=None):
    return TokenDelta("r", 0, list(ids), None, finish, num_prompt_tokens=2, num_cached_tokens=0, error=error)


def test_a_stop_string_ends_the_sample_here_and_asks_for_an_abort():
    out = SampleOutput(Letters(), stop=["cd"])
    assert out.push(delta([0, 1, 2])) == "ab"          # "c" may begin the stop string: held back
    assert out.push(delta([3, 4])) == ""
    assert (out.finish_reason, out.stop_reason, out.stop_string, out.text) == ("stop", "cd", "cd", "ab")
    assert out.stopped_here and out.token_ids == [0, 1, 2, 3, 4]
    assert out.push(delta([5], finish="length")) == "" and out.engine_done and out.token_ids == [0, 1, 2, 3, 4]


def test_the_engine_s_finish_releases_the_held_tail_and_names_its_stop_token():
    out = SampleOutput(Letters(), stop=["cd"], stop_token_ids=[7])
    out.push(delta([0, 2]))
    assert out.push(delta([7], finish="stop")) == "ch"
    assert (out.finish_reason, out.stop_reason, out.engine_done, out.stopped_here) == ("stop", 7, True, False)


def test_offline_without_stop_strings_decodes_once_at_the_end():
    tok = Letters()
    out = SampleOutput(tok, [5, 6], skip_special_tokens=False, streamed=False)
    for i in range(10):
        assert out.push(delta([i, 99] if i == 3 else [i])) == ""
    assert tok.decodes == 0 and out.text == ""
    out.push(delta([10], finish="length"))
    assert out.text == "abcd<s>efghijk" and tok.decodes == 1 and out.finish_reason == "length"


def test_ended_from_outside_keeps_what_came_and_its_error():
    out = SampleOutput(Letters(), streamed=False)
    out.push(delta([0, 1]))
    out.end("error", "the engine stopped", engine_done=True)
    assert (out.text, out.finish_reason, out.error, out.engine_done) == ("ab", "error", "the engine stopped", True)
    out.end("abort")
    assert out.finish_reason == "error"          # set once
