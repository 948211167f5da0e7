"""One decode step's LoRA work alone: every layer's four adds for 32 rows spread round robin over 1, 4 or 16
adapters (rank 16 on all seven projections), through torch's reference (float32 stacks, the batched bmm over the slots) and through
lora_sgmv.c on float32 and on bfloat16 stacks, with bfloat16 rows as the CPU serves SmolLM2.

`python -m bench.lora_kernel --json` (default model's shapes). Best of --repeats, the three alternating.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from actors.config import default_model_path
from actors.worker.lora_adapter import MODULES, LoRAAdapter, module_shapes
from actors.worker.lora_slots import GROUPS, LoRASlots
from kernels import cpu_native, lora, lora_cpu


def _adapters(cfg, count: int, rank: int) -> list[LoRAAdapter]:
    g = torch.Generator().manual_seed(0)
    shapes = module_shapes(cfg)
    return [LoRAAdapter(f"a{i}", "", rank, 2.0, frozenset(MODULES),
                        {(layer, m): (torch.randn(rank, shapes[m][0], generator=g) * 0.01,
                                      torch.randn(shapes[m][1], rank, generator=g) * 0.01)
                         for layer in range(cfg.num_layers) for m in MODULES}) for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--cases", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from actors.model.source import resolve_model_source
    from actors.worker.model_runner import open_model

    torch.set_num_threads(args.threads)
    cfg, weights = open_model(resolve_model_source(args.model))
    weights.close()
    shapes = module_shapes(cfg)
    results = []
    for count in args.cases:
        adapters = _adapters(cfg, count, args.rank)
        pools = {"torch float32": LoRASlots(cfg, count, args.rank, torch.float32, torch.device("cpu"), lora.add_lora),
                 "C float32": LoRASlots(cfg, count, args.rank, torch.float32, torch.device("cpu"), lora_cpu.add_lora),
                 "C bfloat16": LoRASlots(cfg, count, args.rank, torch.bfloat16, torch.device("cpu"), lora_cpu.add_lora)}
        per_row = [adapters[i % count] for i in range(args.rows)]   # round robin, as bench.lora submits them
        batches = {name: pool.batch(per_row, [1] * args.rows) for name, pool in pools.items()}
        x = {g: torch.randn(args.rows, shapes[GROUPS[g][0]][0]).bfloat16() for g in GROUPS}
        out = {g: torch.zeros(args.rows, sum(shapes[m][1] for m in GROUPS[g])).bfloat16() for g in GROUPS}

        def step(batch):
            return lambda: [batch.add(layer, g, x[g], out[g]) for layer in range(cfg.num_layers) for g in GROUPS]
        ms = cpu_native.best_ms({name: step(b) for name, b in batches.items()}, args.repeats)
        stack_mb = {name: round(sum(t.numel() * t.element_size() for s in (*p.a.values(), *p.b.values()) for t in s)
                                / 2 ** 20, 1) for name, p in pools.items()}
        results.append({"adapters": count, "ms": ms, "stacks_mib": stack_mb})
    report = {"model": os.path.basename(args.model), "rows": args.rows, "rank": args.rank, "threads": args.threads,
              "cases": results}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in results:
            print(f"{r['adapters']:>3} adapters: " + ", ".join(f"{n} {t:.2f} ms" for n, t in r["ms"].items()))


if __name__ == "__main__":
    main()
