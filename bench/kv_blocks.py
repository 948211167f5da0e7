"""What a KV handoff costs to gather and scatter: `python -m bench.kv_blocks [--blocks 1,4,32]`.

KVBlockIO reads blocks out of a paged cache shaped like the default model's (30 layers of K and V,
[blocks, 16 slots, 3 kv heads, 64], float32 unless `--dtype`) into one buffer and writes them back
elsewhere. A host cache goes through numpy views of its bytes; `host=False` is the torch path an
accelerator's cache takes, run on the same tensors beside it. Prints the milliseconds per call for
each, and their ratio.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from actors.worker.kv_blocks import KVBlockIO


def best_ms(fn, repeats: int) -> float:
    """fn's best time of `repeats` calls after one warm-up, in ms."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="1,4,32", help="blocks per read and write")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    num_blocks = 160
    caches = [(torch.randn(num_blocks, 16, 3, 64).to(dtype), torch.randn(num_blocks, 16, 3, 64).to(dtype))
              for _ in range(args.layers)]
    paths = {"numpy": KVBlockIO(caches), "torch": KVBlockIO(caches, host=False)}
    rows = []
    for n in (int(b) for b in args.blocks.split(",")):
        src, dst = list(range(n)), list(range(num_blocks - n, num_blocks))
        data = bytes(paths["numpy"].read(src))
        row = {"blocks": n, "bytes": len(data)}
        for name, io in paths.items():
            row[f"{name}_read_ms"] = best_ms(lambda: io.read(src), args.repeats)
            row[f"{name}_write_ms"] = best_ms(lambda: io.write(dst, data), args.repeats)
        row["read_speedup"] = row["torch_read_ms"] / row["numpy_read_ms"]
        row["write_speedup"] = row["torch_write_ms"] / row["numpy_write_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
