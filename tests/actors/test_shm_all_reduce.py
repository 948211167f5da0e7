"""The CPU ranks' shared-memory all-reduce (kernels/shm_all_reduce.c, chosen by actors/worker/cpu_collectives.py).

Two real processes (this one rank 0, tests/actors/shm_rank.py rank 1) sum float32, bfloat16 and float16
tensors from one value to more than a slot: the result is the float32 sum in rank order rounded once, and
the same bits on both ranks; the LM head's gather of uneven vocabulary slices, larger than a slot, too. A rank killed while the other waits on it makes the other raise RanksLost in
seconds; a rank that never comes, at the deadline. `--tp-all-reduce` (MATINEE_TP_ALL_REDUCE) is what the
ranks use.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from actors.config import EngineConfig
from actors.nodes.engine_ranks import free_port, rank_specs
from actors.worker.tensor_parallel import RanksLost
from kernels import cpu_native
from kernels.shm_all_reduce import ShmGroup, ShmFailure, create
from tests.actors import shm_rank

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the C kernels do not build here")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Rank1:
    """tests/actors/shm_rank.py as rank 1: started, then let join once torch is loaded in it."""

    def __init__(self, port: int, choice: str, case: str) -> None:
        env = {**os.environ, "PYTHONPATH": ROOT}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.actors.shm_rank", str(port), choice, case],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        assert self.line() == "imported"
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def line(self) -> str:
        return self.proc.stdout.readline().strip()

    def end(self) -> int:
        """Its exit status: once it ends by itself (within 30 s), else killed."""
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _pair(choice: str, case: str):
    port = free_port("127.0.0.1")
    rank1 = _Rank1(port, choice, case)
    try:
        tp = shm_rank.join(0, port, choice)
    except BaseException:
        rank1.end()
        raise
    return tp, rank1


def test_two_processes_get_the_sum_in_rank_order_bit_for_bit():
    tp, rank1 = _pair("shm", "sums")
    try:
        assert tp.all_reduce_via == "shm" and rank1.line() == "shm"
        for (n, dtype), mine, theirs in zip(shm_rank.CASES, shm_rank.inputs(0), shm_rank.inputs(1)):
            want = (mine.float() + theirs.float()).to(dtype)
            got = tp.all_reduce(mine.clone())
            assert torch.equal(got, want), (n, dtype)
            assert rank1.line() == shm_rank.digest(got), (n, dtype)   # rank 1 holds the same bits
        assert tp.all_reduce_s > 0
        whole = tp.gather_vocab(shm_rank.logits(0))   # the LM head's slices, through the segment too
        assert torch.equal(whole, torch.cat([shm_rank.logits(0), shm_rank.logits(1)], dim=1))
        assert rank1.line() == shm_rank.digest(whole)
    finally:
        tp.close()
        assert rank1.end() == 0


def test_a_rank_killed_mid_wait_raises_ranks_lost_within_seconds():
    tp, rank1 = _pair("shm", "stall")
    try:
        assert rank1.line() == "shm"
        tp.all_reduce(torch.ones(2048))
        assert rank1.line() == "stalling"
        threading.Timer(0.5, os.kill, (rank1.proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(RanksLost, match="rank 1 is gone"):
            tp.all_reduce(torch.ones(2048))   # rank 1 never arrives: it sleeps, then dies
        assert 0.4 < time.monotonic() - t0 < 5   # the group's timeout is 60 s
        with pytest.raises(RanksLost):   # and the group stays broken
            tp.all_reduce(torch.ones(2048))
    finally:
        tp.close()
        assert rank1.end() == -signal.SIGKILL


def test_a_rank_that_never_arrives_fails_at_the_deadline(tmp_path):
    path = str(tmp_path / "segment")
    create(path, 2, 1024)
    ranks = [ShmGroup(path, r, 2, timeout_s=0.5, slot_bytes=1024) for r in range(2)]
    try:
        t0 = time.monotonic()
        with pytest.raises(ShmFailure, match="rank 1 did not arrive within 0.5 s"):
            ranks[0].all_reduce(torch.ones(10))   # rank 1 lives (holds its lock) but never calls
        assert 0.5 <= time.monotonic() - t0 < 3
    finally:
        for r in ranks:
            r.close()


def test_ranks_out_of_step_are_caught(tmp_path):
    """Ranks that reduce different tensors (a bug) fail the round instead of summing unrelated bytes."""
    path = str(tmp_path / "segment")
    create(path, 2, 1024)
    ranks = [ShmGroup(path, r, 2, timeout_s=10, slot_bytes=1024) for r in range(2)]
    errors = []

    def reduce(r: int, n: int) -> None:
        try:
            ranks[r].all_reduce(torch.ones(n))
        except ShmFailure as e:
            errors.append(str(e))

    threads = [threading.Thread(target=reduce, args=(r, 10 + r)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for r in ranks:
        r.close()
    assert len(errors) == 2 and all("called with another tensor" in e for e in errors)


@pytest.mark.parametrize("choice", ["gloo", "auto"])
def test_the_choice_is_the_ranks_and_theirs_alike(choice):
    """gloo is gloo; auto is what rank 0 measured faster, on both ranks (shm on one host, where it builds)."""
    tp, rank1 = _pair(choice, "sums")
    try:
        via = rank1.line()
        assert tp.all_reduce_via == via and via in (["gloo"] if choice == "gloo" else ["gloo", "shm"])
        for mine in shm_rank.inputs(0):
            got = tp.all_reduce(mine)
            assert rank1.line() == shm_rank.digest(got)
        whole = tp.gather_vocab(shm_rank.logits(0))   # before reading rank 1's line: it waits on this one
        assert rank1.line() == shm_rank.digest(whole)
    finally:
        tp.close()
        assert rank1.end() == 0


def test_the_flag_and_its_environment_variable_reach_the_ranks(tiny_model_dir):
    from gateway import cli
    from gateway.roles import engine_kwargs

    flags = ["serve", "--model", tiny_model_dir("llama"), "--tensor-parallel-size", "2"]
    for env, want in [({}, "auto"), ({"MATINEE_TP_ALL_REDUCE": "shm"}, "shm"),
                      ({"MATINEE_TP_ALL_REDUCE": "gloo"}, "gloo")]:
        config = EngineConfig(**engine_kwargs(cli.build_parser(env).parse_args(flags)))
        assert config.tp_all_reduce == want and {s.all_reduce for s in rank_specs(config)} == {want}
    two_nodes = EngineConfig(model=tiny_model_dir("llama"), tensor_parallel_size=2, nnodes=2, master_port=29500)
    assert {s.all_reduce for s in rank_specs(two_nodes)} == {"gloo"}   # shared memory spans one host
    with pytest.raises(ValueError, match="shm needs every rank on one host"):
        EngineConfig(model=tiny_model_dir("llama"), tensor_parallel_size=2, nnodes=2, master_port=29500,
                     tp_all_reduce="shm")
    with pytest.raises(ValueError, match="MATINEE_TP_ALL_REDUCE='fast' is not one of"):
        cli.build_parser({"MATINEE_TP_ALL_REDUCE": "fast"})
