"""The tensor-parallel ranks one node runs as child processes (`python -m actors.worker.tp_rank`), and
their supervision: a rank that exits while the engine runs is reported (once) to whoever watches, so the
engine fails as a whole (its node stops and the cluster moves its streams to another engine) instead of
waiting on a collective that can never finish.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable

import msgspec

from actors.worker.tensor_parallel import RankSpec
from actors.worker.tp_rank import RankLaunch
from runtime import get_logger

log = get_logger(component="tp-ranks")


class RankProcesses:
    def __init__(self, ranks: list[RankSpec], runner_kwargs: dict, device: str, per_node: int) -> None:
        """Starts one process per spec; on CUDA each takes the GPU of its place among the node's `per_node`
        ranks (rank 0 keeps the first)."""
        self._stopping = False
        self._lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen] = {}
        for spec in ranks:
            kwargs = dict(runner_kwargs)
            if device.startswith("cuda"):
                kwargs["device"] = f"cuda:{spec.rank % per_node}"
            arg = msgspec.json.encode(RankLaunch(spec, kwargs)).decode()
            self.procs[spec.rank] = subprocess.Popen([sys.executable, "-m", "actors.worker.tp_rank", arg],
                                                     env=_child_env())
        log.info("tensor-parallel ranks started", ranks=sorted(self.procs), pids=[p.pid for p in self.procs.values()])

    def watch(self, on_exit: Callable[[int, int], None]) -> None:
        """Calls on_exit(rank, status) from a watcher thread when a rank ends before stop()."""
        for rank, proc in self.procs.items():
            threading.Thread(target=self._wait, args=(rank, proc, on_exit), daemon=True,
                             name=f"tp-rank-{rank}-watch").start()

    def _wait(self, rank: int, proc: subprocess.Popen, on_exit: Callable[[int, int], None]) -> None:
        status = proc.wait()
        with self._lock:
            if self._stopping:
                return
            self._stopping = True   # one report: the first rank lost fails the engine
        log.error("tensor-parallel rank exited", rank=rank, status=status)
        on_exit(rank, status)

    def wait(self) -> int:
        """Waits for every rank (a node that only hosts ranks); the first non-zero status, else 0."""
        statuses = [p.wait() for p in self.procs.values()]
        return next((s for s in statuses if s), 0)

    def stop(self, timeout_s: float = 10.0) -> None:
        """After rank 0 stopped the group: waits for the ranks to leave, and kills those that do not."""
        with self._lock:
            self._stopping = True
        for proc in self.procs.values():
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        with self._lock:
            self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _child_env() -> dict[str, str]:
    """The engine's environment, with the project importable from wherever the child starts."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env
