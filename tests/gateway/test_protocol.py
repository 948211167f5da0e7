"""Request decoding and validation: every bad input is a 400 naming its param, never a crash."""
import msgspec
import pytest

from gateway import protocol
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics


def chat(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    req = protocol.decode(msgspec.json.encode(body), protocol.ChatRequest)
    protocol.validate_chat(req)
    return req


def completion(**fields):
    body = {"model": "m", "prompt": "hi", **fields}
    req = protocol.decode(msgspec.json.encode(body), protocol.CompletionRequest)
    protocol.validate_completion(req)
    return req


@pytest.mark.parametrize("fields, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": protocol.MAX_N + 1}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop": ["x"] * (protocol.MAX_STOP + 1)}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": True, "top_logprobs": protocol.MAX_LOGPROBS + 1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"seed": 2 ** 64}, "seed"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
])
def test_chat_errors_name_the_param(fields, param):
    with pytest.raises(APIError) as e:
        chat(**fields)
    assert e.value.status == 400
    assert e.value.type == "invalid_request_error"
    assert e.value.param is not None and e.value.param.startswith(param)


def test_chat_accepts_openai_shapes():
    req = chat(messages=[{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}],
               temperature=0, stop="x", stream=True,
               stream_options={"include_usage": True, "include_obfuscation": False},
               logprobs=True, top_logprobs=3, user="u", safety_identifier="s", priority=-1,
               reasoning_effort="low", seed=1, n=2)
    assert protocol.message_text(req.messages[1]) == "ab"
    assert req.temperature == 0.0 and req.top_logprobs == 3 and req.reasoning_effort == "low"
    assert completion(best_of=2, n=2).best_of == 2


# Every field of openai's chat and completions create params that this server does not implement.
UNSUPPORTED_CHAT = ["audio", "function_call", "functions", "metadata", "modalities", "moderation",
                    "prediction", "prompt_cache_key", "prompt_cache_options",
                    "prompt_cache_retention", "service_tier", "store",
                    "verbosity", "web_search_options", "zz"]
UNSUPPORTED_COMPLETION = ["tools"]


@pytest.mark.parametrize("field", UNSUPPORTED_CHAT)
def test_unsupported_chat_fields_are_a_400_naming_them(field):
    with pytest.raises(APIError) as e:
        chat(**{field: {"type": "json_object"}})
    assert e.value.status == 400 and e.value.param == field and f"`{field}`" in e.value.message


@pytest.mark.parametrize("field", UNSUPPORTED_COMPLETION)
def test_unsupported_completion_fields_are_a_400_naming_them(field):
    with pytest.raises(APIError) as e:
        completion(**{field: True})
    assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "assistant", "content": None, "audio": {}}]}, "messages[0].audio"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"},
                                                         "x": 1}]}]}, "messages[0].tool_calls[0].x"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
     "messages[0].content[0].x"),
    ({"stream": True, "stream_options": {"include_usage": True, "zz": True}}, "stream_options.zz"),
])
def test_unknown_nested_fields_name_their_path(body, param):
    with pytest.raises(APIError) as e:
        chat(**body)
    assert e.value.status == 400 and e.value.param == param


def test_vllm_stream_options_are_accepted():
    req = chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert req.stream_options.continuous_usage_stats is True


@pytest.mark.parametrize("field, value", [
    ("use_beam_search", True), ("length_penalty", 0.5), ("logits_processors", ["my.Proc"]),
    ("vllm_xargs", {"a": 1}), ("kv_transfer_params", {"do_remote_decode": True}),
    ("guided_whitespace_pattern", " "), ("mm_processor_kwargs", {"a": 1}), ("chat_template", "{{x}}"),
])
def test_refused_vllm_fields_name_the_alternative(field, value):
    with pytest.raises(APIError) as e:
        chat(**{field: value})
    assert e.value.status == 400 and e.value.param == field
    assert protocol.REFUSED[field][1] in e.value.message


@pytest.mark.parametrize("field, value", [
    ("use_beam_search", False), ("length_penalty", 1.0), ("logits_processors", []), ("vllm_xargs", {}),
    ("kv_transfer_params", None), ("mm_processor_kwargs", {}), ("guided_decoding_backend", "xgrammar"),
])
def test_refused_vllm_fields_at_their_off_values_are_accepted(field, value):
    assert getattr(chat(**{field: value}), field) == value


def test_prompt_embeds_refused_on_completions():
    with pytest.raises(APIError) as e:
        completion(prompt_embeds="AAAA")
    assert e.value.param == "prompt_embeds" and "text or token ids" in e.value.message


@pytest.mark.parametrize("fields, param", [
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": "x" * (protocol.MAX_CACHE_SALT_CHARS + 1)}, "cache_salt"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words[0]"),
    ({"bad_words": ["a"] * (protocol.MAX_BAD_WORDS + 1)}, "bad_words"),
    ({"request_id": "has space"}, "request_id"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"continue_final_message": True}, "continue_final_message"),   # add_generation_prompt defaults true
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize"),
])
def test_vllm_extension_values_out_of_range_name_the_param(fields, param):
    with pytest.raises(APIError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param


def test_continue_final_message_with_the_generation_prompt_off_is_accepted():
    req = chat(continue_final_message=True, add_generation_prompt=False)
    assert req.continue_final_message and req.add_generation_prompt is False


def test_tokenize_and_detokenize_reject_unknown_fields():
    for body, type_ in ((b'{"prompt": "a", "zz": 1}', protocol.TokenizeRequest),
                        (b'{"tokens": [1], "zz": 1}', protocol.DetokenizeRequest)):
        with pytest.raises(APIError) as e:
            protocol.decode(body, type_)
        assert e.value.param == "zz"


def test_best_of_beyond_n_and_bad_reasoning_effort_are_400s():
    with pytest.raises(APIError) as e:
        completion(best_of=3)
    assert e.value.param == "best_of"
    with pytest.raises(APIError) as e:
        chat(reasoning_effort="extreme")
    assert e.value.param == "reasoning_effort"


def test_body_errors():
    for body in (b"", b"{", b"[1, 2]", b'"str"'):
        with pytest.raises(APIError) as e:
            protocol.decode(body, protocol.ChatRequest)
        assert e.value.status == 400


@pytest.mark.parametrize("prompt", ["", [], [[]], [1, "a"], {"a": 1}, 3, [-1], [10 ** 9], [[1], 2],
                                    ["x"] * (protocol.MAX_PROMPTS + 1)])
def test_completion_prompt_errors(prompt):
    with pytest.raises(APIError) as e:
        req = completion(prompt=prompt)
        protocol.completion_prompts(req.prompt, vocab_size=1000)
    assert e.value.status == 400 and e.value.param == "prompt"


def test_completion_prompt_forms():
    assert protocol.completion_prompts("a", 10) == ["a"]
    assert protocol.completion_prompts(["a", "b"], 10) == ["a", "b"]
    assert protocol.completion_prompts([1, 2], 10) == [[1, 2]]
    assert protocol.completion_prompts([[1], [2, 3]], 10) == [[1], [2, 3]]
    with pytest.raises(APIError) as e:
        completion(logprobs=protocol.MAX_LOGPROBS + 1)
    assert e.value.param == "logprobs"


def test_metrics_render_prometheus_text():
    from prometheus_client.parser import text_string_to_metric_families

    from actors.messages.front_end import EngineStats

    m = GatewayMetrics()
    m.set_model("tiny")
    m.ttft.observe(0.03)
    m.ttft.observe(100.0)
    m.finished("stop")
    m.finished("length", 2)
    m.update_engine(EngineStats(1, 2, 10, 4, 0, 0, 0, 0, 3))
    text = m.render()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("matinee_requests_total", (("finish_reason", "stop"),))] == 1
    assert samples[("matinee_requests_total", (("finish_reason", "length"),))] == 2
    assert samples[("matinee_time_to_first_token_seconds_bucket", (("le", "0.05"),))] == 1
    assert samples[("matinee_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2
    assert samples[("matinee_time_to_first_token_seconds_count", ())] == 2
    assert samples[("vllm:time_to_first_token_seconds_count", (("model_name", "tiny"),))] == 2
    assert "# TYPE matinee_inter_token_latency_seconds histogram" in text
    for name in ("matinee_requests_running", "matinee_kv_blocks_free", "matinee_preemptions_total",
                 "matinee_prefix_cache_hit_tokens_total", "matinee_request_queue_seconds_sum"):
        assert name in text
    assert samples[("matinee_preemptions_total", ())] == 3 and samples[("matinee_kv_blocks_free", ())] == 4
