"""The engine's host overhead at batch 1: `python -m bench.step_overhead [--dtype bfloat16]
[--decode-burst 1,8] [--repeats 3]`.

One greedy request decodes `--tokens` tokens alone; the step's wall time (the request's time over
its forwards) is set against the model forward alone (the worker's own timer). What is left is
Python: sampling, flattening the batch, the scheduler, the KV manager and the hops between them.
With several `--decode-burst` values, each is measured in its own engine, the engines taking turns
`--repeats` times (this machine drifts by 10-20% within minutes: alternating keeps the comparison
fair). Prints one JSON object per run, then the medians; the target is overhead_frac <= 0.05.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from actors import LLM, SamplingParams


def measure(model: str | None, dtype: str, tokens: int, decode_burst: int) -> dict:
    with LLM(model, dtype=dtype, decode_burst=decode_burst) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0))   # warm-up
        before = llm.stats()
        start = time.perf_counter()
        llm.generate([list(range(10, 42))], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        wall = time.perf_counter() - start
        after = llm.stats()
        resolved = llm.engine.config.resolved_dtype()
    steps = after.steps - before.steps
    forward = after.forward_s - before.forward_s
    return {"dtype": resolved, "decode_burst": decode_burst, "steps": steps, "wall_ms_per_step": wall / steps * 1e3,
            "forward_ms_per_step": forward / steps * 1e3, "overhead_frac": (wall - forward) / wall}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--decode-burst", default="8", help="comma-separated values to compare (default: 8)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    bursts = [int(b) for b in args.decode_burst.split(",")]
    runs: dict[int, list[dict]] = {b: [] for b in bursts}
    for _ in range(args.repeats):
        for b in bursts:
            out = measure(args.model, args.dtype, args.tokens, b)
            runs[b].append(out)
            print(json.dumps(out), flush=True)
    summary = {str(b): {key: statistics.median(r[key] for r in rs)
                        for key in ("wall_ms_per_step", "forward_ms_per_step", "overhead_frac")}
               for b, rs in runs.items()}
    print(json.dumps({"medians": summary}))
    return summary


if __name__ == "__main__":
    main()
