"""Starting and stopping real node processes (tests.runtime.node_main) for cross-process tests."""
import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECRET = "test-cluster-secret"


class NodeProcess:
    def __init__(self, proc: asyncio.subprocess.Process, address: str):
        self.proc = proc
        self.address = address

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.proc.wait(), 10)
        except asyncio.TimeoutError:
            self.kill()
            return await self.proc.wait()


async def start_node(*args: str, secret: str = SECRET) -> NodeProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.runtime.node_main", "--secret", secret, *args,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    words = line.decode().split()
    if len(words) != 2 or words[0] != "READY":
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"node did not start: {line!r}")
    return NodeProcess(proc, words[1])


def start_node_blocking(*args: str, secret: str = SECRET) -> tuple[subprocess.Popen, str]:
    """For module-scoped fixtures, which outlive any one test's event loop."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "tests.runtime.node_main", "--secret", secret, *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE)
    words = proc.stdout.readline().decode().split()
    if len(words) != 2 or words[0] != "READY":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"node did not start: {words!r}")
    return proc, words[1]


def stop_blocking(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
