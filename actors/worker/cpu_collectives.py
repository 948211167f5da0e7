"""Which all-reduce (and LM-head gather) the CPU ranks use: gloo's, or the shared-memory one
(kernels/shm_all_reduce.py) where every rank is on one host and it builds, and under `auto` where it also
measures faster. The plan's broadcasts stay on gloo: a rank past 0 waits in them while the engine idles.

Called by every rank right after the gloo group starts: each step below is a collective over that
group, so the ranks agree on the segment's name (rank 0 picks it), on whether every rank could map it,
and on the choice (rank 0's measurement decides). It never chooses alone: ranks that disagreed would
wait on different collectives.
"""
from __future__ import annotations

import os
import secrets
import statistics
import time

import torch
import torch.distributed as dist

from kernels.shm_all_reduce import ShmGroup, create
from runtime import get_logger

CHOICES = ("auto", "shm", "gloo")
SEGMENTS = "/dev/shm"
PROBE = 4096                  # float32 values timed under `auto`: a decode step's row of a 4096-wide model
WARM_UP, TIMED = 2, 8

log = get_logger(component="tp-all-reduce")


def choose(choice: str, rank: int, size: int, timeout_s: float) -> ShmGroup | None:
    """The shared-memory all-reduce to use, or None for gloo. `shm` that cannot be set up raises
    RuntimeError on every rank (asked for, it is never silently replaced)."""
    if choice not in CHOICES:
        raise ValueError(f"the tensor-parallel all-reduce is one of {CHOICES}, not {choice!r}")
    if choice == "gloo":
        return None
    shm, why = _join(rank, size, timeout_s)
    if shm is None:
        if choice == "shm":
            raise RuntimeError(f"tensor-parallel all-reduce shm: {why}")
        log.info("tensor-parallel all-reduce through gloo", reason=why)
        return None
    if choice == "auto" and not _faster(shm, rank):
        shm.close()
        return None
    return shm


def _join(rank: int, size: int, timeout_s: float) -> tuple[ShmGroup | None, str]:
    """Rank 0 creates a segment under a fresh random name and broadcasts it; every rank maps it; once all
    have said whether they could, rank 0 unlinks the file (the mappings stay). (group or None, why not)."""
    header = torch.zeros(2, dtype=torch.int64)
    why = ""
    if rank == 0:
        header[1] = secrets.randbits(63)
        try:
            create(_path(int(header[1])), size)
            header[0] = 1
        except OSError as e:
            why = f"rank 0 cannot create a segment in {SEGMENTS}: {e}"
    shm = None
    try:
        dist.broadcast(header, 0)
        if header[0]:
            try:
                shm = ShmGroup(_path(int(header[1])), rank, size, timeout_s)
            except OSError as e:   # another host's rank finds no such file
                why = f"rank {rank} cannot map the segment: {e}"
        joined = torch.tensor([int(shm is not None)], dtype=torch.int64)
        dist.all_reduce(joined, dist.ReduceOp.MIN)
    finally:   # every rank has mapped it or given up (or the group failed): the name is no longer needed
        if rank == 0 and header[0]:
            os.unlink(_path(int(header[1])))
    if not joined[0]:
        if shm is not None:
            shm.close()
        return None, why or "a rank could not map the segment (on another host?)"
    return shm, ""


def _faster(shm: ShmGroup, rank: int) -> bool:
    """Each all-reduce timed on a probe row, rank 0's medians deciding for every rank."""
    probe = torch.ones(PROBE, dtype=torch.float32)
    medians = {}
    for name, reduce in (("gloo", dist.all_reduce), ("shm", shm.all_reduce)):
        times = []
        for i in range(WARM_UP + TIMED):
            t0 = time.perf_counter()
            reduce(probe)
            if i >= WARM_UP:
                times.append(time.perf_counter() - t0)
        medians[name] = statistics.median(times)
    decision = torch.tensor([int(medians["shm"] < medians["gloo"])], dtype=torch.int64)
    dist.broadcast(decision, 0)
    if rank == 0:
        log.info("tensor-parallel all-reduce measured", chosen="shm" if decision[0] else "gloo",
                 shm_us=round(medians["shm"] * 1e6, 1), gloo_us=round(medians["gloo"] * 1e6, 1), values=PROBE)
    return bool(decision[0])


def _path(token: int) -> str:
    return os.path.join(SEGMENTS, f"matinee-tp-{token:016x}")
