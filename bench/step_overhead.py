"""The engine's host overhead at batch 1: `python -m bench.step_overhead [--dtype bfloat16]`.

One greedy request decodes `--tokens` tokens alone; the step's wall time (the request's time over
its steps) is set against the model forward alone (the worker's own timer). What is left is Python:
sampling, flattening the batch, the scheduler, the KV manager and the hops between them. Prints one
JSON object; the target is overhead_frac <= 0.05.
"""
from __future__ import annotations

import argparse
import json
import time

from actors import LLM, SamplingParams


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args(argv)
    with LLM(args.model, dtype=args.dtype) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0))   # warm-up
        before = llm.stats()
        start = time.perf_counter()
        llm.generate([list(range(10, 42))], SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
        wall = time.perf_counter() - start
        after = llm.stats()
        dtype = llm.engine.config.resolved_dtype()
    steps = after.steps - before.steps
    forward = after.forward_s - before.forward_s
    out = {"dtype": dtype, "steps": steps, "wall_ms_per_step": wall / steps * 1e3,
           "forward_ms_per_step": forward / steps * 1e3, "overhead_frac": (wall - forward) / wall}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
