"""LoRA adapters over real HTTP: `model` names an adapter, /v1/models lists each with its base as
`parent`, vLLM's load and unload routes (behind the API key, only with runtime updates on), broken
folders refused with a 400 that names the problem, and adapters loaded, unloaded and reloaded while
other requests stream. Tokens are checked against transformers + peft on the same adapter."""
from __future__ import annotations

import json
import random
import re
import shutil
import threading
import time

import pytest

from tests.actors.conftest import TINY_VOCAB, build_tiny_model
from tests.actors.lora_adapters import make_adapter, peft_greedy
from tests.gateway import http_util as http

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_NEW = 8
LONG = 400   # a stream long enough to be running while adapters come and go


class Served:
    def __init__(self, live, base_url, frozen_url, folders, want, prompt, tmp):
        self.live, self.url, self.frozen, self.folders, self.want, self.prompt, self.tmp = \
            live, base_url, frozen_url, folders, want, prompt, tmp


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from actors.config import EngineConfig
    from gateway.config import GatewayConfig
    from tests.gateway.live import LiveServer

    tmp = tmp_path_factory.mktemp("lora-live")
    base = build_tiny_model("llama", str(tmp / "base"))
    folders = {name: make_adapter(base, str(tmp / name), name, seed=i) for i, name in enumerate(("all", "attn"))}
    prompt = [random.Random(5).randrange(4, TINY_VOCAB) for _ in range(20)]
    want = {name: peft_greedy(base, folders.get(name), [prompt], NUM_NEW)[0] for name in (None, "all", "attn")}
    live = LiveServer(EngineConfig(model=base, dtype="float32", num_blocks=256, num_threads=1,
                                   max_num_batched_tokens=64, lora_modules=[f"all={folders['all']}"],
                                   max_loras=2, max_lora_rank=16))
    live.start()
    try:
        url = live.add_app(GatewayConfig(api_key=KEY, served_model_name="tiny", enable_lora_runtime_updates=True))
        frozen = live.add_app(GatewayConfig(api_key=KEY, served_model_name="tiny"))
        yield Served(live, url, frozen, folders, want, prompt, tmp)
    finally:
        live.stop()


def complete(url: str, model: str, prompt: list[int], max_tokens: int = NUM_NEW) -> http.Reply:
    return http.post(url + "/v1/completions", headers=AUTH, json_body={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})


def token_ids(reply: http.Reply) -> list[int]:
    assert reply.status_code == 200, reply.text
    return [int(t.removeprefix("token_id:")) for t in reply.json()["choices"][0]["logprobs"]["tokens"]]


def load(url: str, name: str, path: str, headers=AUTH) -> http.Reply:
    return http.post(url + "/v1/load_lora_adapter", headers=headers, json_body={"lora_name": name, "lora_path": path})


def unload(url: str, name: str) -> http.Reply:
    return http.post(url + "/v1/unload_lora_adapter", headers=AUTH, json_body={"lora_name": name})


def model_ids(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in http.get(url + "/v1/models", headers=AUTH).json()["data"]}


class Stream(threading.Thread):
    """A streamed completion read to its end in a thread: its token ids and finish reason."""

    def __init__(self, url: str, model: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.prompt = url, model, prompt
        self.tokens: list[int] = []
        self.finish = None
        self.started = threading.Event()

    def run(self) -> None:
        conn, resp = http.open_request("POST", self.url + "/v1/completions", headers=AUTH, timeout=120, json_body={
            "model": self.model, "prompt": self.prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True})
        try:
            for line in resp:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                self.tokens += [int(t.removeprefix("token_id:")) for t in (choice.get("logprobs") or {}).get("tokens", [])]
                self.finish = choice.get("finish_reason") or self.finish
                if self.tokens:
                    self.started.set()
        finally:
            conn.close()
            self.started.set()


def test_model_names_an_adapter_and_models_lists_it(served):
    assert token_ids(complete(served.url, "all", served.prompt)) == served.want["all"]
    assert token_ids(complete(served.url, "tiny", served.prompt)) == served.want[None]
    reply = complete(served.url, "nope", served.prompt)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    cards = model_ids(served.url)
    assert cards["all"]["parent"] == "tiny" and cards["all"]["root"] == served.folders["all"]
    assert cards["tiny"]["parent"] is None
    assert http.get(served.url + "/v1/models/all", headers=AUTH).json()["parent"] == "tiny"


def test_load_is_behind_the_key_and_the_flag(served):
    assert load(served.url, "attn", served.folders["attn"], headers={}).status_code == 401
    reply = load(served.frozen, "attn", served.folders["attn"])
    assert reply.status_code == 404 and "--enable-lora-runtime-updates" in reply.json()["error"]["message"]
    assert "attn" not in model_ids(served.url)


@pytest.mark.parametrize("breakage,message", [
    ("missing folder", "does not exist"),
    ("missing weights", "has no adapter_model.safetensors"),
    ("rank too large", "rank 32, more than --max-lora-rank 16"),
    ("wrong base", "(wrong base model?)"),
])
def test_a_bad_folder_is_a_400_naming_the_problem(served, breakage, message):
    folder = str(served.tmp / f"bad-{breakage.replace(' ', '-')}")
    if breakage == "missing weights":
        shutil.copytree(served.folders["attn"], folder)
        (served.tmp / folder / "adapter_model.safetensors").unlink()
    elif breakage == "rank too large":
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(served.tmp / "base"))
        get_peft_model(model, LoraConfig(r=32, target_modules=["q_proj"])).save_pretrained(folder)
    elif breakage == "wrong base":
        qwen = build_tiny_model("qwen2", str(served.tmp / f"qwen-{breakage}"))
        make_adapter(qwen, folder, "all")
    reply = load(served.url, "bad", folder)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    assert "bad" not in model_ids(served.url)   # nothing else changed: the served adapter still answers
    assert token_ids(complete(served.url, "all", served.prompt)) == served.want["all"]


def test_load_unload_reload_while_others_stream(served):
    stream = Stream(served.url, "all", served.prompt)
    stream.start()
    assert stream.started.wait(60)
    assert load(served.url, "attn", served.folders["attn"]).text == "Success: LoRA adapter 'attn' added successfully."
    assert load(served.url, "attn", served.folders["attn"]).status_code == 400   # already loaded
    assert model_ids(served.url)["attn"]["parent"] == "tiny"
    assert token_ids(complete(served.url, "attn", served.prompt)) == served.want["attn"]
    assert unload(served.url, "attn").status_code == 200
    assert complete(served.url, "attn", served.prompt).status_code == 404
    assert unload(served.url, "attn").status_code == 404
    assert load(served.url, "attn", served.folders["attn"]).status_code == 200
    assert token_ids(complete(served.url, "attn", served.prompt)) == served.want["attn"]
    assert stream.finish is None   # all of it while the stream went on
    stream.join(120)
    assert stream.finish == "length" and len(stream.tokens) == LONG
    assert stream.tokens[:NUM_NEW] == served.want["all"]


def test_an_unload_lets_the_running_request_finish_with_its_adapter(served):
    if "attn" not in model_ids(served.url):
        assert load(served.url, "attn", served.folders["attn"]).status_code == 200
    stream = Stream(served.url, "attn", served.prompt)
    stream.start()
    assert stream.started.wait(60)
    assert unload(served.url, "attn").status_code == 200
    assert stream.finish is None   # the unload came while its request was generating
    assert complete(served.url, "attn", served.prompt).status_code == 404
    stream.join(120)
    assert stream.finish == "length" and len(stream.tokens) == LONG
    assert stream.tokens[:NUM_NEW] == served.want["attn"]


def test_metrics_name_the_adapters(served):
    token_ids(complete(served.url, "all", served.prompt))
    text = http.get(served.url + "/metrics", headers=AUTH).text
    assert re.search(r'^vllm:lora_requests_info\{[^}]*max_lora="2"[^}]*\} \S+$', text, re.M), text
    count = re.search(r'^matinee_lora_requests_total\{lora_name="all"\} (\S+)$', text, re.M)
    assert count and float(count.group(1)) >= 2


def test_embeddings_under_an_adapter_differ_from_the_base_models(served):
    def embed(model):
        reply = http.post(served.url + "/v1/embeddings", headers=AUTH, json_body={"model": model, "input": [served.prompt]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == model
        return reply.json()["data"][0]["embedding"]

    base, adapted = embed("tiny"), embed("all")
    assert len(base) == len(adapted) and base != adapted
    assert embed("all") == adapted


def test_a_batch_line_names_an_adapter_as_a_live_request_does(served):
    """Batch lines run through the live routes' code as ballast: `model` picks the adapter there too,
    and a name neither the base model nor an adapter has is that line's own 404."""
    def line(cid: str, model: str) -> dict:
        return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {
            "model": model, "prompt": served.prompt, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}}

    data = b"".join(json.dumps(line(cid, model)).encode() + b"\n"
                    for cid, model in (("lora", "all"), ("base", "tiny"), ("gone", "nope")))
    file_id = http.upload(served.url + "/v1/files", data, headers=AUTH).json()["id"]
    batch = http.post(served.url + "/v1/batches", headers=AUTH, json_body={
        "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}).json()
    deadline = time.monotonic() + 120
    while batch["status"] not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
        time.sleep(0.05)
        batch = http.get(served.url + f"/v1/batches/{batch['id']}", headers=AUTH).json()
    assert batch["status"] == "completed", batch

    def lines(key: str) -> dict[str, dict]:
        text = http.get(served.url + f"/v1/files/{batch[key]}/content", headers=AUTH).text
        return {(d := json.loads(t))["custom_id"]: d["response"] for t in text.splitlines()}

    out, errors = lines("output_file_id"), lines("error_file_id")
    for cid, name in (("lora", "all"), ("base", None)):
        body = out[cid]["body"]
        tokens = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
        assert tokens == served.want[name] and body["model"] == (name or "tiny")
    assert errors["gone"]["status_code"] == 404 and errors["gone"]["body"]["error"]["code"] == "model_not_found"
