"""The Files and Batches API over real HTTP on loopback, driven by the official `openai` client,
on gateways of their own over the shared tiny engine: lines answered as the live endpoint answers,
bad lines in the error file, limits, cancelling, and a restart in the middle of a batch."""
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest
import redis

from gateway.batches_api import BATCH_STORE
from gateway.config import GatewayConfig
from gateway.redis_batch_store import RedisBatchStore
from tests.gateway import http_util as http

MSG = [{"role": "user", "content": "Hello world! How are you today?"}]


REDIS_URL = "redis://127.0.0.1:6379/0"


class Gateway:
    """A gateway of its own on the shared engine, which a test may stop and start again; its batch
    store a directory, or (`namespace`) the shared Redis as in a cluster."""

    def __init__(self, live, config: GatewayConfig, namespace: str | None = None) -> None:
        self.live, self.config, self.namespace = live, config, namespace
        self.start()

    def _use_redis(self, app) -> None:
        async def open_store():
            return RedisBatchStore.from_url(REDIS_URL, self.namespace, lease_s=5.0)
        app[BATCH_STORE] = open_store

    def start(self) -> None:
        self.url = self.live.add_app(self.config, setup=self._use_redis if self.namespace else None)
        self.runner = self.live.runners[-1]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self) -> None:
        self.live.run(self.runner.cleanup(), timeout=60)
        self.live.runners.remove(self.runner)

    def metric(self, name: str) -> float:
        m = re.search(rf"^{re.escape(name)} (\S+)$", http.get(self.url + "/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture
def store(request) -> str:
    """Where the gateway keeps its batches: "dir" unless a test is parametrized over ["dir", "redis"]."""
    return getattr(request, "param", "dir")


@pytest.fixture
def gateway(tiny_servers, tmp_path, store):
    gws, namespace = [], f"test:batch:{os.urandom(8).hex()}" if store == "redis" else None

    def make(**kw) -> Gateway:
        gw = Gateway(tiny_servers.live, GatewayConfig(served_model_name="tiny", disable_access_log=True,
                                                      batch_dir=str(tmp_path / "batches"), **kw), namespace)
        gws.append(gw)
        return gw

    yield make
    for gw in gws:
        if gw.runner in gw.live.runners:
            gw.stop()
    if namespace is not None:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=namespace + ":*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


BOTH_STORES = pytest.mark.parametrize("store", ["dir", "redis"], indirect=True)


def jsonl(lines) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def chat_line(custom_id: str, content: str = MSG[0]["content"], max_tokens: int = 6, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, **body}}


def upload(client, data: bytes):
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")


def wait(client, batch_id: str, until=lambda b: b.status in ("completed", "failed", "cancelled", "expired"),
         timeout: float = 120.0, nodes=()):
    """The batch once `until` holds (by default, once it ended); past `timeout`, an error with its state and
    the logs of `nodes` (a cluster's processes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.05)
    logs = "".join("\n" + n.log() for n in nodes)
    raise AssertionError(f"batch {batch_id} still {batch.status} with {batch.request_counts}{logs}")


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@BOTH_STORES
def test_a_batch_answers_each_line_as_the_live_endpoint_does(gateway):
    gw = gateway()
    finished_before = gw.metric("matinee_batch_requests_finished_total")
    prompts = {"a": "Hello world!", "b": "Name three colours.", "c": "What is two plus two?"}
    f = upload(gw.client, jsonl(chat_line(cid, text) for cid, text in prompts.items()))
    assert f.purpose == "batch" and f.bytes > 0 and gw.client.files.retrieve(f.id).filename == "in.jsonl"
    batch = gw.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                     metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait(gw.client, batch.id)
    assert done.status == "completed", done.errors
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 3, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    out = {line["custom_id"]: line for line in lines_of(gw.client, done.output_file_id)}
    assert set(out) == set(prompts)
    for cid, text in prompts.items():
        live = gw.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                                 max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        line = out[cid]
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["message"]["content"] == live.choices[0].message.content
    assert [b.id for b in gw.client.batches.list().data] == [batch.id]
    assert gw.metric('matinee_batch_lines_total{outcome="completed"}') == 3
    assert gw.metric("matinee_batch_requests_finished_total") == finished_before + 3   # ballast in the engine
    assert gw.metric("matinee_batch_rows_total") >= 3 * 6
    # The gateway's latency histograms are interactive requests': 3 live calls above, no batch line.
    assert gw.metric("matinee_time_to_first_token_seconds_count") == 3
    assert gw.client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        gw.client.files.retrieve(f.id)


def test_completions_and_embeddings_batches(gateway):
    gw = gateway()
    lines = [{"custom_id": "p", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}}]
    done = wait(gw.client, gw.client.batches.create(input_file_id=upload(gw.client, jsonl(lines)).id,
                                                    endpoint="/v1/completions", completion_window="24h").id)
    body = lines_of(gw.client, done.output_file_id)[0]["response"]["body"]
    live = gw.client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert body["choices"][0]["text"] == live.choices[0].text
    lines = [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "Paris"}}]
    done = wait(gw.client, gw.client.batches.create(input_file_id=upload(gw.client, jsonl(lines)).id,
                                                    endpoint="/v1/embeddings", completion_window="24h").id)
    body = lines_of(gw.client, done.output_file_id)[0]["response"]["body"]
    assert body["data"][0]["embedding"] == gw.client.embeddings.create(model="tiny", input="Paris").data[0].embedding


@BOTH_STORES
def test_bad_lines_go_to_the_error_file_and_the_rest_runs(gateway):
    gw = gateway(max_body_bytes=4096)
    data = jsonl([chat_line("good-1"),
                  b'{"custom_id": "broken", "method": "POST", "url": ',          # malformed JSON
                  {**chat_line("elsewhere"), "url": "/v1/nowhere"},              # not this batch's endpoint
                  chat_line("long", content="x" * 5000),                        # over the line limit
                  chat_line("bad-body", temperature=-1),                         # the endpoint's own 400
                  chat_line("good-1"),                                           # a custom_id used twice
                  b"",                                                           # blank lines are skipped
                  chat_line("good-2")])
    done = wait(gw.client, gw.client.batches.create(input_file_id=upload(gw.client, data).id,
                                                    endpoint="/v1/chat/completions", completion_window="24h").id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 2, 5)
    assert sorted(line["custom_id"] for line in lines_of(gw.client, done.output_file_id)) == ["good-1", "good-2"]
    errors = lines_of(gw.client, done.error_file_id)
    codes = [(e["custom_id"], e["error"]["code"] if e["error"] else e["response"]["status_code"]) for e in errors]
    assert codes == [(None, "invalid_json_line"), ("elsewhere", "invalid_url"), (None, "line_too_long"),
                     ("bad-body", 400), ("good-1", "duplicate_custom_id")]
    assert "temperature" in errors[3]["response"]["body"]["error"]["message"]
    assert "at most 4096" in errors[2]["error"]["message"]
    assert gw.metric('matinee_batch_lines_total{outcome="failed"}') == 5


def test_limits_and_bad_requests_are_clear_errors(gateway):
    gw = gateway(batch_max_file_bytes=2048, batch_max_lines=2)
    with pytest.raises(openai.APIStatusError) as e:
        upload(gw.client, b"x" * 4096)
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    assert "2048" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        gw.client.files.create(file=("a.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    f = upload(gw.client, jsonl([chat_line("a"), chat_line("b"), chat_line("c")]))
    for kw, param in (({"endpoint": "/v1/nowhere"}, "endpoint"), ({"completion_window": "soon"}, "completion_window")):
        with pytest.raises(openai.BadRequestError) as e:
            gw.client.batches.create(**{"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                        "completion_window": "24h", **kw})
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        gw.client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions",
                                 completion_window="24h")
    failed = wait(gw.client, gw.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                      completion_window="24h").id)
    assert failed.status == "failed" and failed.errors.data[0].code == "too_many_lines"
    with pytest.raises(openai.ConflictError):
        gw.client.batches.cancel(failed.id)
    with pytest.raises(openai.NotFoundError):
        gw.client.batches.retrieve("batch_missing")


@BOTH_STORES
def test_cancel_keeps_what_finished(gateway):
    gw = gateway(batch_concurrency=1)
    f = upload(gw.client, jsonl(chat_line(f"l{i}", max_tokens=24) for i in range(20)))
    batch = gw.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait(gw.client, batch.id, until=lambda b: b.request_counts.completed >= 1)
    assert gw.client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait(gw.client, batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    finished = lines_of(gw.client, done.output_file_id)
    assert 1 <= len(finished) == done.request_counts.completed < 20


@pytest.mark.slow
def test_a_restart_mid_batch_answers_every_line_exactly_once(gateway, tmp_path):
    gw = gateway(batch_concurrency=2)
    n = 16
    f = upload(gw.client, jsonl(chat_line(f"l{i}", content=f"Line {i}", max_tokens=24) for i in range(n)))
    batch = gw.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait(gw.client, batch.id, until=lambda b: b.request_counts.completed >= 3)
    gw.stop()
    results = tmp_path / "batches" / "batches" / f"{batch.id}.results"
    before = len(results.read_bytes().splitlines())
    assert 3 <= before < n
    gw.start()   # the same directory: the batch resumes
    done = wait(gw.client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == n
    ids = [line["custom_id"] for line in lines_of(gw.client, done.output_file_id)]
    assert sorted(ids) == sorted(f"l{i}" for i in range(n))   # every line, none twice
    assert gw.metric('matinee_batch_lines_total{outcome="completed"}') == n - before   # only the rest ran
    indices = [json.loads(r)["index"] for r in results.read_bytes().splitlines()]
    assert sorted(indices) == list(range(n))
    assert os.path.exists(tmp_path / "batches" / "lock")


@BOTH_STORES
def test_each_api_key_sees_only_its_own_files_and_batches(gateway):
    gw = gateway(api_key=["key-a", "key-b"])
    a = openai.OpenAI(base_url=gw.url + "/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=gw.url + "/v1", api_key="key-b", max_retries=0)
    f = upload(a, jsonl([chat_line("x")]))
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.files.list().data == [] and b.batches.list().data == []
    assert wait(a, batch.id).status == "completed"


@BOTH_STORES
def test_files_expire(gateway, store, tmp_path):
    gw = gateway(batch_file_ttl_s=1.0)
    f = upload(gw.client, jsonl([chat_line("x")]))
    assert gw.client.files.retrieve(f.id).expires_at == f.created_at + 1
    time.sleep(2.1)   # whole seconds, as OpenAI's timestamps
    if store == "dir":   # its bytes go without a request for them (Redis expires its keys itself)
        data = tmp_path / "batches" / "files" / f"{f.id}.data"
        _wait_until(lambda: not data.exists(), "the expired file swept from the directory")
    with pytest.raises(openai.NotFoundError):
        gw.client.files.retrieve(f.id)
    assert gw.client.files.list().data == []


def test_a_batch_past_its_window_at_restart_expires_with_its_lines_in_the_error_file(gateway, tmp_path):
    gw = gateway()
    f = upload(gw.client, jsonl(chat_line(f"l{i}") for i in range(3)))
    batch = gw.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait(gw.client, batch.id)
    gw.stop()
    # As if the server had stopped mid-batch and come back after its window: in progress, one line done.
    path = tmp_path / "batches" / "batches" / f"{batch.id}.json"
    record = json.loads(path.read_bytes())
    record["batch"].update(status="in_progress", expires_at=int(time.time()) - 1, output_file_id=None,
                           error_file_id=None, completed_at=None)
    path.write_text(json.dumps(record))
    results = path.with_suffix(".results")
    results.write_bytes(results.read_bytes().splitlines(keepends=True)[0])
    gw.start()
    done = wait(gw.client, batch.id)
    assert done.status == "expired" and done.expired_at
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 0)
    assert len(lines_of(gw.client, done.output_file_id)) == 1
    errors = lines_of(gw.client, done.error_file_id)
    assert len(errors) == 2 and {e["error"]["code"] for e in errors} == {"batch_expired"}


def _wait_until(check, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_files_and_outputs_expire_as_their_policy_says(gateway):
    gw = gateway()
    f = gw.client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("x")]))), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600 and gw.client.files.retrieve(f.id).expires_at == f.expires_at
    for policy in ({"anchor": "last_active_at", "seconds": 3600}, {"anchor": "created_at", "seconds": 10}):
        with pytest.raises(openai.BadRequestError) as e:
            gw.client.files.create(file=("in.jsonl", io.BytesIO(b"{}")), purpose="batch", expires_after=policy)
        assert e.value.body["param"] == "expires_after"
    with pytest.raises(openai.BadRequestError) as e:
        gw.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                 output_expires_after={"anchor": "created_at", "seconds": 31 * 86400})
    assert e.value.body["param"] == "output_expires_after" and "30 days" in e.value.body["message"]
    done = wait(gw.client, gw.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h",
                                                    output_expires_after={"anchor": "created_at", "seconds": 7200}).id)
    out = gw.client.files.retrieve(done.output_file_id)
    assert out.purpose == "batch_output" and out.expires_at == out.created_at + 7200


@BOTH_STORES
def test_ended_batches_go_after_their_retention(gateway, store, tmp_path):
    # Times are whole seconds: a batch that ends at x.99 is past a 1 s retention 10 ms later, before the poll
    # that sees it ended. Three seconds leave the poll at least two; the sleep runs to the retention's end.
    retention = 3
    gw = gateway(batch_retention_s=float(retention))
    f = upload(gw.client, jsonl([chat_line("a"), chat_line("b", temperature=-1)]))
    done = wait(gw.client, gw.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)
    assert done.output_file_id and done.error_file_id
    time.sleep(max(0.0, done.completed_at + retention + 1.1 - time.time()))
    if store == "dir":   # swept without a request for it
        gone = [tmp_path / "batches" / "batches" / f"{done.id}.json", tmp_path / "batches" / "batches" /
                f"{done.id}.results", tmp_path / "batches" / "files" / f"{done.output_file_id}.data"]
        _wait_until(lambda: not any(p.exists() for p in gone), "the ended batch swept from the directory")
    with pytest.raises(openai.NotFoundError):
        gw.client.batches.retrieve(done.id)
    for file_id in (done.output_file_id, done.error_file_id):
        with pytest.raises(openai.NotFoundError):
            gw.client.files.retrieve(file_id)
    assert gw.client.batches.list().data == []
    assert gw.client.files.retrieve(f.id).id == f.id   # the input keeps its own expiry
    if store == "redis":
        client = redis.Redis.from_url(REDIS_URL)
        assert not list(client.scan_iter(match=f"{gw.namespace}:*{done.id}*"))
        client.close()


def _serve(model_folder: str, port: int, batch_dir: str):
    """A real `matinee serve` process on the tiny model, with its batches in `batch_dir`; once ready."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--model", model_folder, "--port", str(port),
                             "--num-blocks", "128", "--max-num-seqs", "8", "--served-model-name", "tiny",
                             "--num-threads", "1", "--batch-dir", batch_dir, "--batch-concurrency", "2",
                             "--disable-access-log", "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, "matinee serve exited early"
        try:
            if http.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("matinee serve did not get ready")


@pytest.mark.slow
def test_a_server_killed_mid_batch_answers_every_line_exactly_once_after_it_restarts(tiny_model_folder, tmp_path):
    """SIGKILL, not a clean stop: nothing gets to abort or flush; the restarted process takes the
    directory (the dead one's lock went with it) and finishes the batch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    batch_dir, n = str(tmp_path / "batches"), 12
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    proc = _serve(tiny_model_folder, port, batch_dir)
    try:
        f = upload(client, jsonl(chat_line(f"l{i}", content=f"Line {i}", max_tokens=32) for i in range(n)))
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait(client, batch.id, until=lambda b: b.request_counts.completed >= 2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        results = tmp_path / "batches" / "batches" / f"{batch.id}.results"
        assert len(results.read_bytes().splitlines()) < n
        proc = _serve(tiny_model_folder, port, batch_dir)
        done = wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == n
        ids = [line["custom_id"] for line in lines_of(client, done.output_file_id)]
        assert sorted(ids) == sorted(f"l{i}" for i in range(n))
        assert sorted(json.loads(r)["index"] for r in results.read_bytes().splitlines()) == list(range(n))
    finally:
        proc.kill()
        proc.wait(30)
