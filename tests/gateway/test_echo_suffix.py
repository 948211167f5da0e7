"""`echo`, `suffix` (fill in the middle) and `prompt_logprobs` over real HTTP, through the openai client."""
import json
import os
import shutil

import openai
import pytest

from gateway.config import GatewayConfig
from gateway.fill_in_middle import fim_token_ids
from tests.gateway import http_util as http
from tests.gateway.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The quick brown fox jumps"


def _ids(tiny_servers, text: str) -> list[int]:
    return tiny_servers.tokenizer.encode(text)


def test_echo_puts_the_prompt_first_whole_and_streamed(client, tiny_servers):
    kw = dict(model="tiny", prompt=[PROMPT, "Hello world"], max_tokens=4, temperature=0, echo=True,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    plain = client.completions.create(**{**kw, "echo": False})
    by_index = {c.index: c.text for c in whole.choices}
    assert by_index[0] == PROMPT + plain.choices[0].text and by_index[1].startswith("Hello world")
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == by_index
    ids = _ids(tiny_servers, "One two three")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True)
    assert r.choices[0].text.startswith(tiny_servers.tokenizer.decode(ids, skip_special_tokens=False))


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs(client, tiny_servers):
    ids = _ids(tiny_servers, PROMPT)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                  echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    strings = [tiny_servers.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.tokens[:len(ids)] == strings and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])   # keyed by text: two tokens may share one
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(ids)] == len(PROMPT)
    # The prefill's logprob of the last prompt token is the one a decode step gives when that token
    # is drawn after the rest of the prompt (logit_bias forces it; logprobs are taken before bias).
    forced = client.completions.create(model="tiny", prompt=ids[:-1], max_tokens=1, logprobs=0,
                                       logit_bias={str(ids[-1]): 100})
    assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[len(ids) - 1], abs=1e-4)


def test_prompt_logprobs_in_vllms_shape(tiny_servers):
    ids = _ids(tiny_servers, PROMPT)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "n": 2, "temperature": 1.0, "seed": 3,
            "prompt_logprobs": 2}
    r = http.post(tiny_servers.main + "/v1/completions", headers=AUTH, json_body=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    first = choices[0]["prompt_logprobs"]
    assert first[0] is None and len(first) == len(ids)
    for pos, entry in enumerate(first[1:], start=1):
        own = entry[str(ids[pos])]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        assert own["decoded_token"] == tiny_servers.tokenizer.decode([ids[pos]], skip_special_tokens=False)
        # the top 2, and the prompt's own token when it is not among them
        assert sorted(v["rank"] for v in entry.values() if v["rank"] <= 2) == [1, 2]
        assert len(entry) == (2 if own["rank"] <= 2 else 3)
    assert choices[1]["prompt_logprobs"] == first   # every sample of the prompt
    # streamed: on each choice's first chunk
    conn, resp = http.open_request("POST", tiny_servers.main + "/v1/completions", headers=AUTH,
                                   json_body={**body, "stream": True})
    events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
              if line.startswith("data: {")]
    conn.close()
    carrying = [c for e in events for c in e["choices"] if "prompt_logprobs" in c]
    assert sorted(c["index"] for c in carrying) == [0, 1] and carrying[0]["prompt_logprobs"] == first
    chat = http.post(tiny_servers.main + "/v1/chat/completions", headers=AUTH,
                     json_body={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 1, "prompt_logprobs": 0})
    lps = chat.json()["prompt_logprobs"]
    assert lps[0] is None and len(lps) == chat.json()["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in lps[1:])


def test_suffix_needs_fill_in_the_middle_tokens(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="def f(", suffix="\n    return x", max_tokens=2)
    assert e.value.body["param"] == "suffix" and "fill-in-the-middle" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a", suffix="b", echo=True, max_tokens=2)
    assert e.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a", max_tokens=2, extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs"


FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


@pytest.fixture(scope="module")
def fim_server(tiny_model_folder, tmp_path_factory):
    """The tiny model with Qwen's FIM tokens added to its tokenizer (ids inside the model's vocabulary)."""
    from transformers import AutoTokenizer

    from actors.config import EngineConfig
    from tests.gateway.live import LiveServer

    folder = str(tmp_path_factory.mktemp("fim") / "tiny-fim")
    shutil.copytree(tiny_model_folder, folder)
    hf = AutoTokenizer.from_pretrained(folder)
    hf.add_special_tokens({"additional_special_tokens": FIM})
    hf.save_pretrained(folder)
    live = LiveServer(EngineConfig(model=folder, dtype="float32", num_blocks=64, max_num_seqs=4, num_threads=1))
    live.start()
    try:
        yield live.add_app(GatewayConfig(served_model_name="fim")), live.engine.tokenizer
    finally:
        live.stop()


def test_suffix_fills_in_the_middle(fim_server):
    base, tok = fim_server
    pre, suf, mid = fim_token_ids(tok)
    assert tok.hf.convert_ids_to_tokens([pre, suf, mid]) == FIM
    prompt, suffix = "def add(a, b):\n", "\n    return c\n"
    want = [pre, *tok.encode(prompt, add_special_tokens=False), suf,
            *tok.encode(suffix, add_special_tokens=False), mid]
    r = http.post(base + "/v1/completions", json_body={"model": "fim", "prompt": prompt, "suffix": suffix,
                                                       "max_tokens": 3, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(want)
    seen = [int(next(iter(e))) for e in body["choices"][0]["prompt_logprobs"][1:]]
    assert seen == want[1:]   # the engine was given prefix, suffix, middle in that order
    assert isinstance(body["choices"][0]["text"], str)
