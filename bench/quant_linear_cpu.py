"""CPU projections by weight format: int8 (torch._int_mm, activations per token) and int4 (torch's
_weight_int4pack_mm_for_cpu) against the float32 and bf16 kernels the CPU backend runs today.

SmolLM2-135M's seven projections over LAYERS distinct layers, so each call reads its weight from
memory as a decode step does. Prints ms per step (best of REPEATS) and the weight bytes read per
second for each format and row count; asserts nothing about speed.

    python -m bench.quant_linear_cpu [--threads 2] [--layers 10] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kernels import cpu_gemm, cpu_native, packed_linear, quant_linear_cpu
from kernels.quantize import int4_group_size_for, quantize_int4, quantize_int8

HIDDEN, KV, INTER = 576, 192, 1536
PROJECTIONS = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
               (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
ROWS = [1, 8, 32]
REPEATS = 5


def _bytes(weight) -> int:
    if torch.is_tensor(weight):
        return weight.numel() * weight.element_size()
    return sum(_bytes(t) for t in vars(weight).values() if torch.is_tensor(t))


def formats(floats: list[torch.Tensor]) -> dict[str, tuple[list, object, torch.dtype]]:
    """name -> (the layer stack's weights, the linear that multiplies them, activation dtype)."""
    table = {"float32": (floats, cpu_gemm.linear, torch.float32)}
    if cpu_native.available():
        table["bf16_packed"] = ([packed_linear.pack(w) for w in floats], packed_linear.matmul, torch.bfloat16)
    table["int8"] = ([quantize_int8(w) for w in floats], quant_linear_cpu.linear, torch.float32)
    int4 = [quantize_int4(w, int4_group_size_for(w.shape[1])) for w in floats]
    table["int4_f32"] = ([quant_linear_cpu.prepare_int4(w, torch.float32) for w in int4], quant_linear_cpu.linear,
                         torch.float32)
    table["int4_bf16"] = ([quant_linear_cpu.prepare_int4(w, torch.bfloat16) for w in int4], quant_linear_cpu.linear,
                          torch.bfloat16)
    return table


def measure_rows(name: str, weights, weight_bytes: int, linear, dtype: torch.dtype, widths, repeats: int,
                 gen: torch.Generator, rows=ROWS) -> list[dict]:
    """A step's time over `weights` at each row count (inputs of each width in `widths`), printed as it goes."""
    results = []
    for m in rows:
        x_by_k = {k: torch.randn(m, k, generator=gen).to(dtype) for k in widths}
        ms = step_ms(weights, linear, x_by_k, repeats)
        results.append(dict(format=name, rows=m, ms=round(ms, 3), weight_mb=round(weight_bytes / 1e6, 1),
                            weight_gb_s=round(weight_bytes / ms / 1e6, 2)))
        print(f"{name:>12} rows {m:3d}: {ms:8.3f} ms  {weight_bytes / 1e6:7.1f} MB  "
              f"{weight_bytes / ms / 1e6:6.2f} GB/s", flush=True)
    return results


def step_ms(weights, linear, x_by_k, repeats: int) -> float:
    best = float("inf")
    for repeat in range(repeats + 1):
        start = time.perf_counter()
        for w in weights:
            linear(x_by_k[w.shape[1] if torch.is_tensor(w) else w.in_features], w)
        if repeat:   # the first is a warm-up
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    floats = [torch.randn(n, k, generator=gen) * k ** -0.5 for _ in range(args.layers) for n, k in PROJECTIONS]
    results = []
    for name, (weights, linear, dtype) in formats(floats).items():
        weight_bytes = sum(_bytes(w) for w in weights)
        results += measure_rows(name, weights, weight_bytes, linear, dtype, (HIDDEN, INTER), args.repeats, gen)
    print(json.dumps({"threads": args.threads, "layers": args.layers, "results": results}))


if __name__ == "__main__":
    main()
