"""A tensor-parallel engine in a cluster: `--tensor-parallel-size 2` on the CPU (two processes, gloo) serves
the tokens a one-process engine serves, and when its second rank is killed mid-stream the engine stops
(exit status 1) and the gateway finishes the streams on the other engine with the same text."""
from __future__ import annotations

import glob
import os
import random
import signal
import threading

import pytest

from tests.cluster import harness as h

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("qwen2", str(tmp_path_factory.mktemp("tp-tiny")))


def _children(pid: int) -> list[int]:
    found = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(path) as f:
            found += [int(c) for c in f.read().split()]
    return found


def _complete(base: str, prompt: list[int], max_tokens: int) -> str:
    status, body = h.http_json("POST", base + "/v1/completions",
                               {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True})
    assert status == 200, body
    return body["choices"][0]["text"]


def test_a_killed_rank_moves_its_streams_to_another_engine(model, tmp_path):
    redis = h.RedisServer()
    tp_port, one_port, gw_port = h.free_port(), h.free_port(), h.free_port()
    base = f"http://127.0.0.1:{gw_port}"
    nodes: list[h.Node] = []

    def wait_engines(n: int) -> None:
        h.wait_until(lambda: h.metric(base, "matinee_engines") == n, 180, f"{n} engines", nodes)

    try:
        redis.start()
        tp_engine = h.Node(h.engine_args(model, redis.url, tp_port) + ["--tensor-parallel-size", "2",
                                                                       "--num-threads", "1"],
                           str(tmp_path / "engine-tp.log")).start()
        nodes.append(tp_engine)
        nodes.append(h.Node(h.gateway_args(model, redis.url, gw_port), str(tmp_path / "gateway.log")).start())
        wait_engines(1)
        (rank1,) = _children(tp_engine.proc.pid)
        rng = random.Random(5)
        prompts = [[rng.randrange(4, 360) for _ in range(40)] for _ in range(2)]
        # On the tensor-parallel engine alone: its text, and its cache holds the prompts (routing follows).
        expected = [_complete(base, p, 100) for p in prompts]
        nodes.append(h.Node(h.engine_args(model, redis.url, one_port), str(tmp_path / "engine-one.log")).start())
        wait_engines(2)
        assert [_complete(base, p, 100) for p in prompts] == expected   # one process or two: the same text
        before = h.metric(base, "matinee_request_migrations_total")
        killed = threading.Event()
        lock = threading.Lock()

        def kill_rank(n: int) -> None:
            with lock:
                if n >= 10 and not killed.is_set():
                    os.kill(rank1, signal.SIGKILL)
                    killed.set()

        out: dict[int, tuple] = {}
        body = {"model": "tiny", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, h.stream_text(
            base + "/v1/completions", {**body, "prompt": prompts[i]}, on_event=kill_rank))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert killed.is_set()
        assert tp_engine.proc.wait(60) == 1   # the engine stopped itself, it was not killed
        for i in range(2):
            text, errors = out[i]
            assert not errors
            assert text == expected[i]
        assert h.metric(base, "matinee_request_migrations_total") > before
    finally:
        for node in nodes:
            node.kill()
        redis.stop()
