"""CPU paged decode attention: the committed kernel (HEAD) against the working tree's, timed, the working
tree's with its prefetches into L1 and into L2 (the level paged_attention_cpu.py measures per machine).

SmolLM2-135M's geometry (9 query heads, 3 KV heads, head_dim 64, block size 16) over 30 distinct
layer caches, or with `--geometry llama-1b` the 1B Llama shape's (32 query heads, 8 KV heads, 16 layers),
so each call reads its K/V from memory as a decode step does, not from cache. Prints
ms per step of all layers (best of 5) and the K+V read rate at the faster level; asserts nothing about speed.
`--prefill`: fresh prompts of 256 and 512 tokens through the prefill kernel instead, with its GFLOP/s (the
causal half of QK^T and PV).

    python -m bench.attention_cpu [--threads 2] [--q-len 1] [--prefill] [--geometry llama-1b]
                                  [--batches 1,8,32] [--contexts 500,2000]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kernels import cpu_native

SOURCE = Path(cpu_native.__file__).with_name("paged_attention_cpu.c")
GEOMETRIES = {"smollm2": (30, 9, 3), "llama-1b": (16, 32, 8)}   # layers, query heads, KV heads
D, BLOCK = 64, 16


def build(source: str, directory: Path, name: str) -> ctypes.CDLL:
    """The kernel alone, compiled as cpu_native compiles it for this CPU."""
    src, lib = directory / f"{name}.c", directory / f"{name}.so"
    src.write_text(source)
    for header in cpu_native.HEADERS:   # the headers the kernel includes, beside it
        (directory / header.name).write_bytes(header.read_bytes())
    subprocess.run(["cc", *cpu_native._FLAGS, *cpu_native.NATIVE, str(src), "-o", str(lib), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def step_ms(lib, dtype, batch, ctx, q_len, threads, geometry="smollm2", repeats=5, short_max=None):
    layers, hq, hk = GEOMETRIES[geometry]
    blocks = (ctx + BLOCK - 1) // BLOCK
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(batch * blocks, BLOCK, hk, D, generator=gen).to(dtype)
    caches = [(base.clone(), base.clone()) for _ in range(layers)]   # distinct memory per layer
    tables = torch.randperm(batch * blocks, generator=gen).to(torch.int32).view(batch, blocks)
    q = torch.randn(batch * q_len, hq, D, generator=gen).to(dtype)
    out = torch.empty_like(q)
    starts = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    fn = lib.matinee_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_long] * 8 + [ctypes.c_float] + [ctypes.c_int] * 3 + [ctypes.c_long]
    bf16 = int(dtype == torch.bfloat16)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, v in caches:
            status = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None, tables.data_ptr(), starts.data_ptr(),
                        lens.data_ptr(), out.data_ptr(), batch, batch * q_len, hq, hk, D, BLOCK, blocks,
                        batch * blocks, D ** -0.5, threads, bf16, bf16, q_len if short_max is None else short_max)
            if status:
                raise RuntimeError(f"kernel status {status}")
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, out.clone()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--prefill", action="store_true", help="fresh prompts through the prefill kernel")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="smollm2")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    parser.add_argument("--contexts", default="500,2000", help="context lengths, comma-separated")
    args = parser.parse_args()
    layers, _, hk = GEOMETRIES[args.geometry]
    with tempfile.TemporaryDirectory() as tmp:
        old = build(subprocess.run(["git", "show", "HEAD:kernels/paged_attention_cpu.c"], capture_output=True,
                                   text=True, check=True, cwd=SOURCE.parent).stdout, Path(tmp), "old")
        new = build(SOURCE.read_text(), Path(tmp), "new")
        if args.prefill:
            prefill(old, new, args.threads, args.geometry)
            return
        print(f"q_len {args.q_len}, {args.threads} threads, {layers} layers; ms per step (best of 5)")
        new.matinee_attention_prefetch_to.restype = ctypes.c_int
        print(f"{'dtype':8} {'batch':>5} {'ctx':>5} {'old ms':>8} {'new L1':>8} {'new L2':>8} {'speedup':>7} "
              f"{'new GB/s':>8}")
        for dtype in (torch.float32, torch.bfloat16):
            for batch in map(int, args.batches.split(",")):
                for ctx in map(int, args.contexts.split(",")):
                    t_old, o_old = step_ms(old, dtype, batch, ctx, args.q_len, args.threads, args.geometry)
                    t_new, diff = {}, 0.0
                    for level in (1, 2):
                        new.matinee_attention_prefetch_to(level)
                        t_new[level], o_new = step_ms(new, dtype, batch, ctx, args.q_len, args.threads, args.geometry)
                        diff = max(diff, (o_old.float() - o_new.float()).abs().max().item())
                    best = min(t_new.values())
                    gbytes = 2 * layers * batch * ctx * hk * D * o_new.element_size() / 1e9
                    print(f"{str(dtype)[6:]:8} {batch:5} {ctx:5} {t_old:8.2f} {t_new[1]:8.2f} {t_new[2]:8.2f} "
                          f"{t_old / best:6.2f}x {gbytes / best * 1e3:8.1f}   (max |old - new| {diff:.1e})")


def prefill(old, new, threads, geometry):
    """Fresh prompts (the chunk is the whole sequence) through the prefill kernel: runs longer than 5 tokens."""
    layers, hq, _ = GEOMETRIES[geometry]
    print(f"fresh prompts, {threads} threads, {layers} layers; ms per step (best of 5)")
    print(f"{'dtype':8} {'batch':>5} {'tokens':>6} {'old ms':>8} {'new ms':>8} {'speedup':>7} {'new GFLOP/s':>11}")
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 2, 4):
            for q_len in (256, 512):
                t_old, o_old = step_ms(old, dtype, batch, q_len, q_len, threads, geometry, short_max=5)
                t_new, o_new = step_ms(new, dtype, batch, q_len, q_len, threads, geometry, short_max=5)
                diff = (o_old.float() - o_new.float()).abs().max().item()
                gflop = 4 * layers * batch * hq * D * q_len * (q_len + 1) / 2 / 1e9
                print(f"{str(dtype)[6:]:8} {batch:5} {q_len:6} {t_old:8.2f} {t_new:8.2f} {t_old / t_new:6.2f}x "
                      f"{gflop / t_new * 1e3:11.1f}   (max |old - new| {diff:.1e})")


if __name__ == "__main__":
    main()
