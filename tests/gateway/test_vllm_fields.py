"""vLLM's request extensions over real HTTP, each doing what README's field table says.

The engine is the tiny random-weight llama (gibberish text), so each test checks tokens, counts
and the rendered prompt rather than meaning.
"""
import openai
import pytest

from gateway import api_types
from gateway.config import GatewayConfig
from tests.gateway import http_util as http
from tests.gateway.conftest import API_KEY
from tests.gateway.test_live_api import conforms

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = dict(model="tiny", temperature=0)

# A template that shows what it was given: documents, a custom kwarg, and the generation prompt.
TEMPLATE = (
    "<|endoftext|>{% if documents %}{% for d in documents %}[doc {{ d['title'] }}: {{ d['text'] }}]{% endfor %}{% endif %}"
    "{% if flavour is defined %}(flavour {{ flavour }}){% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def templated(tiny_servers):
    base = tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny", chat_template=TEMPLATE))
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def ids_of(tiny_servers, text: str) -> list[int]:
    return http.post(tiny_servers.main + "/tokenize", headers=AUTH,
                     json_body={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def text_of(tiny_servers, ids: list[int]) -> str:
    reply = http.post(tiny_servers.main + "/detokenize", headers=AUTH, json_body={"model": "tiny", "tokens": ids})
    assert reply.status_code == 200, reply.text
    return reply.json()["prompt"]


def rendered(client, messages, **extra) -> str:
    """The prompt the server built (from its prompt logprobs: every token but the first)."""
    r = client.chat.completions.create(messages=messages, max_tokens=1, **GREEDY,
                                       extra_body={"prompt_logprobs": 0, **extra})
    return "".join(next(iter(e.values()))["decoded_token"] for e in r.model_extra["prompt_logprobs"][1:])


def output_ids(r) -> list[int]:
    """A completion's token ids, named by vLLM's return_tokens_as_token_ids."""
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]


def test_continuous_usage_stats_puts_usage_so_far_in_every_chunk(client):
    for create, kw in ((client.completions.create, dict(prompt="Hello world")),
                       (client.chat.completions.create, dict(messages=[{"role": "user", "content": "Hi"}]))):
        chunks = list(create(**kw, **GREEDY, max_tokens=6, stream=True, extra_body={"ignore_eos": True},
                             stream_options={"include_usage": True, "continuous_usage_stats": True}))
        assert all(c.usage is not None for c in chunks)
        final = chunks[-1]
        assert final.choices == [] and final.usage.completion_tokens == 6
        counts = [c.usage.completion_tokens for c in chunks[:-1]]
        assert counts == sorted(counts) and counts[-1] == 6
        assert all(c.usage.prompt_tokens == final.usage.prompt_tokens for c in chunks)
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        schema = api_types.Completion if "prompt" in kw else api_types.ChatCompletionChunk
        for c in chunks:
            conforms(c.model_dump_json(exclude_unset=True).encode(), schema)


def test_stream_options_include_usage_defaults_to_true_as_in_vllm(client):
    kw = dict(prompt="Hello", **GREEDY, max_tokens=3, stream=True)
    with_options = list(client.completions.create(**kw, stream_options={}))
    assert with_options[-1].usage.completion_tokens == 3 and with_options[-1].choices == []
    turned_off = list(client.completions.create(**kw, stream_options={"include_usage": False}))
    assert all(c.usage is None for c in turned_off)


def test_cache_salt_keeps_requests_with_other_salts_off_the_cached_prefix(client):
    prompt = "A salted prompt about tea, long enough to fill more than one block of sixteen tokens. " * 2
    kw = dict(prompt=prompt, **GREEDY, max_tokens=1)
    client.completions.create(**kw, extra_body={"cache_salt": "alpha"})
    again = client.completions.create(**kw, extra_body={"cache_salt": "alpha"})
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    other = client.completions.create(**kw, extra_body={"cache_salt": "beta"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    unsalted = client.completions.create(**kw)
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, tiny_servers):
    prompt = list(range(5, 45))
    kw = dict(**GREEDY, max_tokens=4, extra_body={"ignore_eos": True})
    cut = client.completions.create(prompt=prompt, **{**kw, "extra_body": {**kw["extra_body"],
                                                                            "truncate_prompt_tokens": 8}})
    tail = client.completions.create(prompt=prompt[-8:], **kw)
    assert cut.usage.prompt_tokens == 8 and cut.choices[0].text == tail.choices[0].text
    whole = client.completions.create(prompt=prompt, **{**kw, "extra_body": {"ignore_eos": True,
                                                                              "truncate_prompt_tokens": -1}})
    assert whole.usage.prompt_tokens == 40
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=prompt, **GREEDY, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 10 ** 6})
    assert e.value.body["param"] == "truncate_prompt_tokens"
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "one two three four"}],
                                          **GREEDY, max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3


def test_generation_prompt_and_continue_final_message_shape_the_rendered_prompt(templated):
    msgs = [{"role": "user", "content": "Name a fruit."}]
    assert rendered(templated, msgs).endswith("<|im_start|>assistant\n")
    assert rendered(templated, msgs, add_generation_prompt=False).endswith("Name a fruit.<|im_end|>\n")
    partial = msgs + [{"role": "assistant", "content": "It is a"}]
    assert rendered(templated, partial, add_generation_prompt=False,
                    continue_final_message=True).endswith("<|im_start|>assistant\nIt is a")


def test_chat_echo_puts_the_open_assistant_message_before_the_reply(client):
    msgs = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "It is a"}]
    kw = dict(messages=msgs, **GREEDY, max_tokens=4,
              extra_body={"add_generation_prompt": False, "continue_final_message": True})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    echo = dict(kw, extra_body={**kw["extra_body"], "echo": True})
    assert client.chat.completions.create(**echo).choices[0].message.content == "It is a" + plain
    streamed = client.chat.completions.create(**echo, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "It is a" + plain
    user_last = client.chat.completions.create(messages=msgs[:1], **GREEDY, max_tokens=4, extra_body={"echo": True})
    assert not user_last.choices[0].message.content.startswith("Name a fruit.")


def test_chat_template_kwargs_and_documents_reach_the_template(templated):
    msgs = [{"role": "user", "content": "Summarise."}]
    assert "(flavour" not in rendered(templated, msgs)
    assert "(flavour mint)" in rendered(templated, msgs, chat_template_kwargs={"flavour": "mint"})
    docs = [{"title": "Tea", "text": "Tea is a drink."}]
    assert "[doc Tea: Tea is a drink.]" in rendered(templated, msgs, documents=docs)
    with pytest.raises(openai.BadRequestError) as e:
        rendered(templated, msgs, chat_template_kwargs={"chat_template": "{{ 1 }}"})
    assert e.value.body["param"] == "chat_template_kwargs.chat_template"


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, tiny_servers):
    kw = dict(prompt="Hello world", **GREEDY, max_tokens=5, logprobs=2)
    by_id = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    ids = output_ids(by_id)
    assert len(ids) == 5 and by_id.choices[0].text == plain.choices[0].text
    named = [text_of(tiny_servers, [t]) for t in ids if t < tiny_servers.tokenizer.vocab_size]
    assert named == [s for t, s in zip(ids, plain.choices[0].logprobs.tokens)
                     if t < tiny_servers.tokenizer.vocab_size]
    assert all(k.startswith("token_id:") for tops in by_id.choices[0].logprobs.top_logprobs for k in tops)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **GREEDY, max_tokens=3,
                                          logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    assert all(t.token.startswith("token_id:") for t in chat.choices[0].logprobs.content)


def test_allowed_token_ids_limit_every_sampled_token(client):
    kw = dict(prompt="Hello world", model="tiny", max_tokens=12, logprobs=0, seed=3)
    r = client.completions.create(**kw, extra_body={"allowed_token_ids": [9, 17, 33], "ignore_eos": True,
                                                    "return_tokens_as_token_ids": True})
    assert len(output_ids(r)) == 12 and set(output_ids(r)) <= {9, 17, 33}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"allowed_token_ids": [10 ** 7]})
    assert e.value.body["param"] == "allowed_token_ids"


def test_bad_words_never_appear_in_the_output(client, tiny_servers):
    kw = dict(prompt=[5, 6, 7, 8], **GREEDY, max_tokens=16, logprobs=0)
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    greedy = output_ids(client.completions.create(**kw, extra_body=body))
    first = next(t for t in greedy if 3 < t < tiny_servers.tokenizer.vocab_size)   # a token with text
    word = text_of(tiny_servers, [first])
    spellings = [ids_of(tiny_servers, word.strip()), ids_of(tiny_servers, " " + word.strip())]
    banned = output_ids(client.completions.create(**kw, extra_body={**body, "bad_words": [word]}))
    assert first in greedy and first not in banned
    for spelled in spellings:
        n = len(spelled)
        assert all(banned[i:i + n] != spelled for i in range(len(banned))), (spelled, banned)


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    kw = dict(prompt="Hello world", **GREEDY, max_tokens=24)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[6:9]
    cut = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})
    kept = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True,
                                                                    "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop
    assert kept.choices[0].finish_reason == cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**kw, stop=[stop], stream=True,
                                         extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == kept.choices[0].text


def test_spaces_between_special_tokens_is_accepted_and_changes_nothing(client):
    kw = dict(prompt=[5, 6, 7], **GREEDY, max_tokens=8, extra_body={"skip_special_tokens": False, "ignore_eos": True})
    texts = {client.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "spaces_between_special_tokens": v}})
             .choices[0].text for v in (True, False)}
    assert len(texts) == 1


def test_request_id_names_the_response_and_may_repeat(client, tiny_servers):
    kw = dict(messages=[{"role": "user", "content": "Hi"}], **GREEDY, max_tokens=2)
    first = client.chat.completions.create(**kw, extra_body={"request_id": "job-42"})
    second = client.chat.completions.create(**kw, extra_body={"request_id": "job-42"})
    assert first.id == second.id == "chatcmpl-job-42"
    completion = client.completions.create(prompt="Hi", model="tiny", max_tokens=2, extra_body={"request_id": "c-1"})
    assert completion.id == "cmpl-c-1"
    header = http.post(tiny_servers.main + "/v1/chat/completions", headers={**AUTH, "X-Request-Id": "from-header"},
                       json_body={**kw, "request_id": "from-body"})
    assert header.json()["id"] == "chatcmpl-from-header"   # as vLLM: the header first


def test_priority_is_honoured_only_under_the_priority_policy(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt="Hi", model="tiny", max_tokens=1, extra_body={"priority": 3})
    assert e.value.body["param"] == "priority" and "--scheduling-policy priority" in e.value.body["message"]


def test_refused_fields_are_400s_that_name_the_alternative(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], model="tiny",
                                       max_tokens=1, extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search" and "`n` samples" in e.value.body["message"]


async def test_add_special_tokens_adds_the_tokenizers_bos_to_a_chat_prompt(tmp_path):
    """Off by default for chat (templates write their own BOS), as vLLM; on, the rendered text is
    tokenized with the tokenizer's special tokens. A tokenizer that adds BOS shows the difference."""
    from tokenizers.processors import TemplateProcessing

    from actors.text.tokenizer import Tokenizer
    from gateway import protocol
    from gateway.handlers import render_chat
    from tests.actors.conftest import build_tiny_tokenizer

    fast = build_tiny_tokenizer(str(tmp_path))
    fast._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok = Tokenizer(fast)
    msgs = [protocol.ChatMessage(role="user", content="Hi")]
    plain = await render_chat(tok, msgs)
    special = await render_chat(tok, msgs, add_special_tokens=True)
    assert plain[0] != 0 and special == [0] + plain
    assert tok.encode("Hi", add_special_tokens=False) == tok.encode("Hi")[1:]   # completions' switch
