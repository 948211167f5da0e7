"""What `--batch-invariant` costs: the offline chat workload (bench.engine's) through `LLM` with and without
it, the two engines taking turns `--repeats` times (this machine drifts between minutes: alternating keeps the
comparison fair). Prints one JSON object per run, then the medians and the flag's cost as a fraction of
throughput; asserts nothing about speed.

    python -m bench.batch_invariance [--model PATH] [--dtype bfloat16] [--requests 48] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from actors import LLM, SamplingParams
from bench.engine import make_chat_workload


def run(model: str | None, dtype: str, invariant: bool, requests: int, vocab: int) -> dict:
    work = make_chat_workload(requests, vocab, seed=0, scale=1.0)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    with LLM(model, dtype=dtype, batch_invariant=invariant) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2))   # warm-up: kernels built, measured
        start = time.perf_counter()
        llm.generate(work.prompts, params)
        wall = time.perf_counter() - start
    return {"batch_invariant": invariant, "tok_s": work.output_tokens / wall, "wall_s": wall}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below it")
    args = ap.parse_args(argv)
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for invariant in (False, True):
            result = run(args.model, args.dtype, invariant, args.requests, args.vocab)
            runs[invariant].append(result["tok_s"])
            print(json.dumps(result), flush=True)
    off, on = statistics.median(runs[False]), statistics.median(runs[True])
    print(json.dumps({"median_tok_s": {"off": off, "on": on}, "cost": 1 - on / off}))


if __name__ == "__main__":
    main()
