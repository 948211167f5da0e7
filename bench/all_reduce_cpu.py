"""One all-reduce of two CPU ranks, gloo's against shared memory's (kernels/shm_all_reduce.c), at the
shapes a tensor-parallel forward all-reduces: a decode step's rows of the hidden width.

    python -m bench.all_reduce_cpu [--width 2048] [--rows 1 64] [--dtypes bfloat16 float32] [--calls 200]
                                   [--json PATH]

Rank 0 is this process, rank 1 a spawned one; each runs on its own half of the usable cores, as the
engine places its ranks. For each shape the two all-reduces alternate in blocks of 10 calls (a
neighbour's load slows both alike), every call timed on rank 0's clock from its start to the sum being
there (so it holds any wait for rank 1). Prints the median and p90 microseconds of each and their ratio.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from datetime import timedelta

BLOCK = 10


def _join(rank: int, port: int):
    import torch.distributed as dist

    from actors.worker import cpu_collectives

    cores = sorted(os.sched_getaffinity(0))   # halves, as the engine splits them (rank 1 starts unpinned)
    half = cores[rank * len(cores) // 2:(rank + 1) * len(cores) // 2]
    if half:
        os.sched_setaffinity(0, half)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    return dist, cpu_collectives.choose("shm", rank, 2, 120.0)


def _run(rank: int, port: int, shapes: list[tuple[int, str]], width: int, calls: int) -> dict:
    import torch

    torch.set_num_threads(1)
    dist, shm = _join(rank, port)
    out = {}
    for rows, dtype in shapes:
        x = torch.randn(rows, width).to(getattr(torch, dtype))
        times: dict[str, list[float]] = {"gloo": [], "shm": []}
        for _ in range(-(-calls // BLOCK) + 1):   # the first block of each: a warm-up, not kept
            for name, reduce in (("gloo", dist.all_reduce), ("shm", shm.all_reduce)):
                block = []
                for _ in range(BLOCK):
                    t = x.clone()
                    t0 = time.perf_counter()
                    reduce(t)
                    block.append(time.perf_counter() - t0)
                times[name] += block
        out[f"{rows}x{width} {dtype}"] = {
            name: {"median_us": statistics.median(ts[BLOCK:]) * 1e6,
                   "p90_us": statistics.quantiles(ts[BLOCK:], n=10)[-1] * 1e6} for name, ts in times.items()}
    shm.close()
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048, help="values a row (the model's hidden size)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--calls", type=int, default=200, help="timed calls of each all-reduce a shape")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    from actors.nodes.engine_ranks import free_port

    cores = len(os.sched_getaffinity(0))   # before rank 0 pins itself to its half
    port = free_port("127.0.0.1")
    shapes = [(rows, dtype) for dtype in args.dtypes for rows in args.rows]
    rank1 = multiprocessing.get_context("spawn").Process(target=_run, args=(1, port, shapes, args.width, args.calls))
    rank1.start()
    try:
        out = _run(0, port, shapes, args.width, args.calls)
    finally:
        rank1.join(120)
    print(f"{'':24}{'gloo median':>12}{'gloo p90':>10}{'shm median':>12}{'shm p90':>10}{'gloo/shm':>10}   (us)")
    for shape, r in out.items():
        g, s = r["gloo"], r["shm"]
        print(f"{shape:24}{g['median_us']:12.1f}{g['p90_us']:10.1f}{s['median_us']:12.1f}{s['p90_us']:10.1f}"
              f"{g['median_us'] / s['median_us']:10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": cores, "calls": args.calls, **out}, f, indent=2)
    return out


if __name__ == "__main__":
    main()
