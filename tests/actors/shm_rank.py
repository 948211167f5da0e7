"""Rank 1 of a two-rank group for test_shm_all_reduce.py, as a process of its own:

    python -m tests.actors.shm_rank PORT CHOICE CASE

It says "imported" and waits for a line on stdin (so the test's rendezvous clock starts once torch is
loaded), joins the group with the all-reduce CHOICE, prints which one the group chose, then runs CASE:
`sums` (every tensor of `inputs(1)` all-reduced, then `logits(1)` gathered with rank 0's, a digest of each
result printed) or `stall` (one all-reduce, then sleeps until killed).
"""
from __future__ import annotations

import hashlib
import sys
import time

import torch

from actors.worker.shard_plan import ShardPlan
from actors.worker.tensor_parallel import RankSpec, TensorParallel

# Sizes from one value to more than a slot (4 MiB): 1.5M float32 values and 3M bfloat16 go in two pieces.
CASES = [(1, torch.float32), (7, torch.float32), (2048, torch.float32), (64 * 2048, torch.float32),
         (1_500_001, torch.float32), (2048, torch.bfloat16), (5 * 2048 + 3, torch.bfloat16),
         (3_000_003, torch.bfloat16), (2048, torch.float16), (1001, torch.float16)]


def inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(n, generator=g).mul_(1 + 10 * rank).to(dtype) for n, dtype in CASES]


VOCAB = [5000, 4999]   # uneven slices: padded to gather; 300 rows of 5000 float32 are more than a slot


def plans() -> list[ShardPlan]:
    """Two ranks' vocabularies (the only part of a plan the group reads)."""
    return [ShardPlan(0, 2, range(0), range(0), range(0), range(0, VOCAB[0])),
            ShardPlan(1, 2, range(0), range(0), range(0), range(VOCAB[0], sum(VOCAB)))]


def logits(rank: int) -> torch.Tensor:
    return torch.randn(300, VOCAB[rank], generator=torch.Generator().manual_seed(2000 + rank))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def join(rank: int, port: int, choice: str, timeout_s: float = 60.0) -> TensorParallel:
    return TensorParallel(RankSpec(rank, 2, "127.0.0.1", port, timeout_s, [], choice), plans(), torch.device("cpu"))


def main(argv: list[str]) -> int:
    port, choice, case = int(argv[1]), argv[2], argv[3]
    print("imported", flush=True)
    sys.stdin.readline()
    tp = join(1, port, choice)
    print(tp.all_reduce_via, flush=True)
    if case == "sums":
        for t in inputs(1):
            print(digest(tp.all_reduce(t)), flush=True)
        print(digest(tp.gather_vocab(logits(1))), flush=True)
    else:
        tp.all_reduce(torch.ones(2048))
        print("stalling", flush=True)
        time.sleep(600)
    tp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
