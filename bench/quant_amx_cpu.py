"""GGUF projections on AMX (kernels/quant_amx.c, widening the packed weight each call) against torch's bf16
`linear` (oneDNN, on the weight already dequantized to bf16: what an engine holding bf16 weights runs).

SmolLM2-135M's Q4_1 projections (qkv, o, gate_up, down) and its Q8_0 output head, random weights, at the row
counts of a decode step (32) and of prefill steps (512, 2048). Prints ms per call (best of `--repeats`) and
the ratio; asserts nothing about speed. On a CPU without AMX it says so and stops.

    python -m bench.quant_amx_cpu [--threads 2] [--rows 32,512,2048] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.kv_blocks import best_ms
from kernels import quant_amx, quant_linear

SHAPES = [("qkv", quant_linear.Q4_1, 960, 576), ("o", quant_linear.Q4_1, 576, 576),
          ("gate_up", quant_linear.Q4_1, 3072, 576), ("down", quant_linear.Q4_1, 576, 1536),
          ("lm_head", quant_linear.Q8_0, 49152, 576)]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="32,512,2048")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(name for name, *_ in SHAPES))
    args = ap.parse_args(argv)
    if not quant_amx.available():
        print("no AMX on this CPU")
        return []
    torch.set_num_threads(args.threads)
    out = []
    for name, qtype, n, k in SHAPES:
        if name not in args.shapes.split(","):
            continue
        weight = quant_amx._random_weight(qtype, n, k)
        dense = quant_linear.dequantize(weight).to(torch.bfloat16)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
            amx = best_ms(lambda: quant_amx.matmul(x, weight), args.repeats)
            onednn = best_ms(lambda: torch.nn.functional.linear(x, dense), args.repeats)
            row = {"shape": name, "n": n, "k": k, "rows": rows, "amx_ms": round(amx, 4),
                   "torch_bf16_ms": round(onednn, 4), "amx_tflops": round(2 * rows * n * k / amx / 1e9, 2),
                   "torch_over_amx": round(onednn / amx, 2)}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


if __name__ == "__main__":
    main()
