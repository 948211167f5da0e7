"""Reasoning parsers: thinking to reasoning_content, the answer to content, on any split of the
stream; structured outputs and tool calls apply to the answer only."""
import itertools
import json
import os
import shutil

import openai
import pytest

from gateway.config import GatewayConfig
from gateway.formats import ChatFormat
from gateway.generation import ChoiceDelta
from gateway.reasoning import PARSERS, ReasoningStream, after_thinking, split
from gateway.responses import Envelope
from gateway.tool_parsers import PARSERS as TOOL_PARSERS

OUTPUTS = [
    ("I think.</think>The answer.", True, ("I think.", "The answer.")),
    ("<think>I think.</think>\n\nThe answer.", True, ("I think.", "\n\nThe answer.")),
    ("  <think>x</think>y", True, ("x", "y")),
    ("Still thinking when cut <", True, ("Still thinking when cut <", "")),
    ("No tags at all.", True, ("No tags at all.", "")),
    ("An answer, thinking off.</think>", False, ("", "An answer, thinking off.</think>")),
    ("a </thin b</think>c", True, ("a </thin b", "c")),
    ("</think>", True, ("", "")),
    ("<thi", True, ("<thi", "")),
]


@pytest.mark.parametrize("text, thinking, expected", OUTPUTS)
def test_every_split_of_the_stream_gives_the_whole_outputs_split(text, thinking, expected):
    assert split(text, thinking) == expected
    for cuts in itertools.combinations(range(1, len(text)), 2):   # three pieces, cut anywhere
        stream, reasoning, content = ReasoningStream(thinking), "", ""
        for a, b in zip((0,) + cuts, cuts + (len(text),)):
            r, c = stream.push(text[a:b])
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        assert (reasoning + r, content + c) == expected, cuts


def test_which_requests_start_inside_the_thinking():
    qwen3, r1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]
    assert qwen3.thinks(None, "<|im_start|>assistant\n<think>\n")
    assert qwen3.thinks({}, "<|im_start|>assistant\n")   # the model opens it itself
    assert not qwen3.thinks({"enable_thinking": False}, "<|im_start|>assistant\n")
    assert not qwen3.thinks(None, "assistant\n<think>\n\n</think>\n\n")   # the template closed it
    assert r1.thinks({"enable_thinking": False}, "<｜Assistant｜><think>\n")   # not R1's switch
    assert not r1.thinks(None, "<think>\n\n</think>\n\n")


def delta(i, text, finish=None):
    return ChoiceDelta(i, text, [1] * max(1, len(text) // 3), None, finish)


def test_tool_calls_are_parsed_in_the_answer_only():
    """A call written while thinking is thinking; the one in the answer is a call."""
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    pieces = ["Maybe ", call[:20], call[20:] + " no.</thi", "nk>Sure.", call]
    streamed = ChatFormat(Envelope("chatcmpl", "r", "m"), str, 1, None, tool_parser=TOOL_PARSERS["hermes"](),
                          thinking=True)
    chunks = [streamed.chunk(delta(0, p)) for p in pieces] + [streamed.chunk(delta(0, "", "stop"))]
    deltas = [c["choices"][0]["delta"] for c in chunks if c]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Maybe " + call + " no."
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1})]
    whole = ChatFormat(Envelope("chatcmpl", "r", "m"), str, 1, None, tool_parser=TOOL_PARSERS["hermes"](),
                       thinking=True)
    for p in pieces:
        whole.add(delta(0, p))
    whole.add(delta(0, "", "stop"))
    message = whole.whole({})["choices"][0]["message"]
    assert message["reasoning_content"] == "Maybe " + call + " no."
    assert message["content"] == "Sure." and len(message["tool_calls"]) == 1


def test_a_legacy_structural_tag_cannot_follow_the_thinking():
    from actors.messages.front_end import StructuredOutput
    from gateway.errors import APIError
    legacy = StructuredOutput("structural_tag", json.dumps({"structures": [], "triggers": []}))
    with pytest.raises(APIError) as e:
        after_thinking(legacy, "structured_outputs.structural_tag")
    assert e.value.param == "structured_outputs.structural_tag"


# A template that opens the thinking in the prompt, or closes it at once with enable_thinking false.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_servers(tiny_model_folder, tmp_path_factory):
    """The tiny llama with `<think>` and `</think>` in its vocabulary, behind a gateway with the
    qwen3 parser and one without a parser."""
    from actors.config import EngineConfig
    from tests.actors.conftest import build_tiny_tokenizer
    from tests.gateway.live import LiveServer

    folder = str(tmp_path_factory.mktemp("thinking-llama"))
    for name in os.listdir(tiny_model_folder):
        if name.endswith((".json", ".safetensors")) and not name.startswith("tokenizer"):
            shutil.copy(os.path.join(tiny_model_folder, name), folder)
    tok = build_tiny_tokenizer(folder)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(folder)
    live = LiveServer(EngineConfig(model=folder, dtype="float32", num_blocks=128, block_size=16,
                                   max_num_seqs=8, max_num_batched_tokens=64, num_threads=1))
    live.start()
    try:
        def client(**config):
            base = live.add_app(GatewayConfig(served_model_name="tiny", **config))
            return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client(reasoning_parser="qwen3"), client(), tok.convert_tokens_to_ids("</think>")
    finally:
        live.stop()


MSGS = [{"role": "user", "content": "Is tea a drink?"}]
GREEDY = dict(model="tiny", messages=MSGS, temperature=0)


def test_a_cut_off_thinking_is_all_reasoning_and_enable_thinking_false_all_answer(thinking_servers):
    parsed, plain, _ = thinking_servers
    raw = plain.chat.completions.create(**GREEDY, max_tokens=6).choices[0].message.content
    thought = parsed.chat.completions.create(**GREEDY, max_tokens=6).choices[0].message
    assert "</think>" not in raw and thought.model_extra["reasoning_content"] == raw and not thought.content
    off = dict(GREEDY, max_tokens=6, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    answered = parsed.chat.completions.create(**off).choices[0].message
    assert answered.model_extra["reasoning_content"] is None
    assert answered.content == plain.chat.completions.create(**off).choices[0].message.content


def test_the_end_of_thinking_splits_the_stream_and_the_whole_alike(thinking_servers):
    parsed, plain, end = thinking_servers
    kw = dict(GREEDY, max_tokens=4, logit_bias={str(end): 100}, extra_body={"ignore_eos": True})
    assert plain.chat.completions.create(**kw).choices[0].message.content == "</think>" * 4
    whole = parsed.chat.completions.create(**kw).choices[0].message
    assert whole.model_extra["reasoning_content"] is None and whole.content == "</think>" * 3
    chunks = [c.choices[0].delta for c in parsed.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(d.content or "" for d in chunks) == "</think>" * 3
    assert not any(d.model_extra.get("reasoning_content") for d in chunks)


def test_streamed_thinking_is_documented_chunks_joining_into_the_whole_message(thinking_servers):
    from gateway import api_types
    from tests.gateway.test_live_api import conforms

    parsed, _, _ = thinking_servers
    kw = dict(GREEDY, max_tokens=6)
    whole = parsed.chat.completions.create(**kw).choices[0].message
    from tests.gateway import http_util as http
    stream = http.post(str(parsed.base_url) + "chat/completions", json_body=dict(kw, stream=True))
    events = [line[len("data: "):] for line in stream.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    for event in events:
        conforms(event.encode(), api_types.ChatCompletionChunk)
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events if json.loads(e)["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.model_extra["reasoning_content"]


def test_a_structured_output_constrains_the_answer_after_the_thinking(thinking_servers):
    """`</think>` (favoured by its bias) is the first token: a grammar over the whole output would
    refuse it; after it the answer validates against the schema."""
    parsed, _, end = thinking_servers
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    kw = dict(GREEDY, max_tokens=40, logit_bias={str(end): 100}, logprobs=True,
              response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
              extra_body={"return_tokens_as_token_ids": True})
    r = parsed.chat.completions.create(**kw).choices[0]
    assert r.logprobs.content[0].token == f"token_id:{end}"
    answer = json.loads(r.message.content)
    assert isinstance(answer["a"], int) and r.finish_reason == "stop"
