"""CPU projections on GGUF weights served packed: the K-quants (Q4_K, Q5_K, Q6_K, IQ4_XS) against the 32-block
types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) through the same kernel file (quant_gemm.c), and the packed bf16
kernel on the same weights dequantized (what `--quantization none --dtype bfloat16` would multiply).

Llama-3.2-1B's seven projections (hidden 2048, KV 512, MLP 8192: every width whole 256-value
super-blocks, which SmolLM2's 576 is not) over LAYERS layers, so each call reads its weight from memory
as a decode step does. The blocks are random bytes with a small fixed scale: the time does not depend on
the values. Prints ms per step (best of REPEATS) and weight GB/s; asserts nothing about speed.

    python -m bench.kquant_cpu [--threads 2] [--layers 2] [--repeats 5] [--rows 1,8,32] [--types Q4_0,Q4_K,...]
"""
from __future__ import annotations

import argparse
import json

import torch
from gguf.constants import GGMLQuantizationType as Q

from bench.quant_linear_cpu import measure_rows
from kernels import cpu_native, packed_linear, quant_linear
from kernels.quant_linear import QuantTensor

HIDDEN, KV, INTER = 2048, 512, 8192
PROJECTIONS = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
               (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
ROWS = [1, 8, 32]
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    parser.add_argument("--types", default=",".join(t.name for t in TYPES), help="GGUF types, comma-separated")
    args = parser.parse_args(argv)
    if not cpu_native.available():
        raise SystemExit("the CPU C kernels are not available here")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(args.layers) for s in PROJECTIONS]
    results = []

    def run(name: str, weights: list, linear, dtype: torch.dtype) -> None:
        weight_bytes = sum(w.packed.numel() * w.packed.element_size() for w in weights)
        results.extend(measure_rows(name, weights, weight_bytes, linear, dtype, (HIDDEN, INTER), args.repeats, gen,
                                    rows))

    rows = [int(r) for r in args.rows.split(",")]
    for qtype in [Q[name] for name in args.types.split(",")]:
        weights = [quant_linear.pack(QuantTensor(int(qtype), quant_linear.random_blocks(qtype, n, k, seed), k),
                                     torch.bfloat16) for seed, (n, k) in enumerate(shapes)]
        run(qtype.name, weights, quant_linear.matmul, torch.bfloat16)
        if qtype == Q.Q4_K:   # the same weights dequantized, in the bf16 kernel's layout
            packed = [packed_linear.pack(quant_linear.dequantize(w).to(torch.bfloat16)) for w in weights]
            run("Q4_K->bf16", packed, packed_linear.matmul, torch.bfloat16)
            del packed
        del weights
    print(json.dumps({"threads": args.threads, "layers": args.layers, "results": results}))


if __name__ == "__main__":
    main()
