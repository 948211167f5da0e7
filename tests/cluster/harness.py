"""Real processes for the cluster tests: a private redis-server, engine and gateway nodes on
loopback, and small HTTP and actor-level probes to see where requests went."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "cluster-test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server of our own on a free port, so a test may stop it."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Node:
    """One `matinee serve --role ...` process; its output goes to a log file for failures."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None):
        self.args, self.log_path = args, log_path
        self.env = {**os.environ, "MATINEE_CLUSTER_SECRET": SECRET, "PYTHONPATH": ROOT,
                    "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> Node:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *self.args],
                                     cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def terminate(self, timeout: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]


def engine_args(model: str, redis_url: str, port: int) -> list[str]:
    return ["--role", "engine", "--model", model, "--dtype", "float32", "--num-blocks", "384",
            "--max-num-batched-tokens", "512", "--redis-url", redis_url, "--listen-port", str(port),
            "--engine-id", f"engine-{port}", "--registry-ttl", "2"]


def gateway_args(model: str, redis_url: str, port: int, *extra: str) -> list[str]:
    return ["--role", "gateway", "--model", model, "--served-model-name", "tiny", "--redis-url", redis_url,
            "--port", str(port), *extra]


def wait_until(check, timeout: float, what: str, nodes=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        for n in nodes:
            if n.proc is not None and n.proc.poll() is not None:
                raise AssertionError(f"{what}: a node exited early:\n{n.log()}")
        time.sleep(0.2)
    logs = "\n".join(n.log() for n in nodes)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def http_json(method: str, url: str, body=None, timeout: float = 60,
              api_key: str | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    except OSError:
        return 0, ""
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def metric(base: str, name: str, api_key: str | None = None) -> float:
    """Sum of a metric's samples (all label sets) from /metrics."""
    _, text = http_json("GET", base + "/metrics", api_key=api_key)
    total, seen = 0.0, False
    for line in str(text).splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else float("nan")


def stream_text(url: str, body: dict, on_event=None, timeout: float = 120) -> tuple[str, list]:
    """A streamed completion's text, and the error events it carried."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    text, errors, n = "", [], 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                errors.append(ev["error"])
                continue
            text += ev["choices"][0]["text"]
            n += 1
            if on_event is not None:
                on_event(n)
    return text, errors


def engine_loads(redis_url: str) -> dict[str, int]:
    """{engine address: requests running or waiting}, asked of every registered engine."""
    from actors.messages.front_end import GetStats
    from runtime import ActorSystem
    from runtime.redis_registry import RedisRegistry

    async def probe() -> dict[str, int]:
        registry = RedisRegistry(redis_url, secret=SECRET)
        system = ActorSystem("probe", secret=SECRET)
        await system.start()
        try:
            out = {}
            for node, path in (await registry.entries("engines/")).values():
                s = await system.ref_for(node, path).ask(GetStats(), timeout=5)
                out[node] = s.requests_running + s.requests_waiting
            return out
        finally:
            await system.shutdown()
            await registry.close()

    return asyncio.run(probe())
