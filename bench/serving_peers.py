"""`matinee serve` against vLLM's CPU server or llama.cpp's llama-server at fixed concurrency levels,
one server at a time.

`python -m bench.serving_peers --peers vllm --concurrency 1,8,32 --json out.json` starts Matinee
(each `--dtype` in turn), runs every level, stops it; then vLLM's OpenAI server (each
`--vllm-dtype`), the same, and checks that no vLLM process is left. Each engine has the machine to
itself: two servers on two cores measure each other. Workload: prompts of exactly `--input-len`
random token ids (/v1/completions, so both see the same tokens), `--output-len` tokens each with
ignore_eos, streamed; max(--min-requests, 2 x concurrency) requests per level, fresh prompts per
level (no prefix-cache hits across levels). Reports output tok/s, TTFT and ITL p50/p90 per level,
and Matinee's figures over the peer's. `--peers llamacpp` runs llama-server on the same GGUF
(`--llamacpp-model`, Matinee's default model's file unless given), with as many slots as the
highest level and `--llamacpp-threads` threads.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from bench import peers, serving
from bench.serving_data import make_requests

FIGURES = {"output_tok_s": ("output_tok_s", None), "ttft_p50_s": ("ttft_s", "p50"), "ttft_p90_s": ("ttft_s", "p90"),
           "itl_p50_s": ("itl_s", "p50"), "itl_p90_s": ("itl_s", "p90")}


def _levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",")]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers, e.g. 1,8,32")
    return levels


def _dtypes(text: str) -> list[str]:
    dtypes = [d for d in text.split(",") if d]
    bad = set(dtypes) - {"auto", "float32", "bfloat16", "float16"}
    if bad:
        raise argparse.ArgumentTypeError(f"unknown dtype {sorted(bad)}")
    return dtypes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serving_peers", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--peers", default="vllm", choices=["vllm", "llamacpp", "none"], help="the peer after Matinee")
    p.add_argument("--concurrency", type=_levels, default=[1, 8, 32], help="fixed concurrency levels")
    p.add_argument("--dtype", type=_dtypes, default=["auto"], help="Matinee's dtypes, each a server run")
    p.add_argument("--vllm-dtype", type=_dtypes, default=["bfloat16"], help="vLLM's dtypes, each a server run")
    p.add_argument("--quantization", default="auto", help="Matinee's --quantization")
    p.add_argument("--llamacpp-model", default=None, help="llama-server's GGUF (default: Matinee's default model)")
    p.add_argument("--llamacpp-threads", type=int, default=2, help="llama-server's -t")
    p.add_argument("--llamacpp-server", default=peers.LLAMACPP_SERVER)
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (ignore_eos)")
    p.add_argument("--min-requests", type=int, default=8, help="requests per level: max(this, 2 x level)")
    p.add_argument("--vocab-size", type=int, default=49152, help="prompt ids are drawn from its middle")
    p.add_argument("--model", default=None, help="Matinee's model (default: SmolLM2's GGUF)")
    p.add_argument("--threads", type=int, default=None, help="Matinee's --num-threads")
    p.add_argument("--vllm-model", default=peers.VLLM_MODEL)
    p.add_argument("--vllm-python", default=peers.VLLM_PYTHON)
    p.add_argument("--vllm-omp-bind", default=peers.VLLM_OMP_BIND, help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp", help="each server's log goes here")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def servers(args: argparse.Namespace) -> list[peers.Server]:
    """Matinee's runs first, then the peer's: the order they run in, one at a time."""
    out = [peers.Server.matinee(d, args.log_dir, args.model, args.threads, args.quantization) for d in args.dtype]
    if args.peers == "llamacpp":
        from actors.model.source import default_model_path

        out.append(peers.Server.llamacpp(args.log_dir, args.llamacpp_model or default_model_path(),
                                         max(args.concurrency), args.llamacpp_threads, args.llamacpp_server))
    if args.peers == "vllm":
        out += [peers.Server.vllm(d, args.log_dir, args.vllm_omp_bind, args.vllm_model, args.vllm_python)
                for d in args.vllm_dtype]
    return out


def level_requests(level: int, args: argparse.Namespace):
    return make_requests("random-ids", max(args.min_requests, 2 * level), input_len=args.input_len,
                         output_len=args.output_len, range_ratio=0.0, seed=args.seed * 1000 + level,
                         vocab_size=args.vocab_size)


async def sweep(base: str, model: str, args: argparse.Namespace, headers: dict | None = None) -> list[dict]:
    """Every level on one server, after a discarded warm-up (first-use compiles are not measured)."""
    headers = headers or {}
    load = dict(rate=None, headers=headers, ignore_eos=True, seed=args.seed, slo_ttft=1e9, slo_tpot=1e9)
    warm = make_requests("random-ids", 2, input_len=args.input_len, output_len=4, range_ratio=0.0,
                         seed=10**6 + args.seed, vocab_size=args.vocab_size)
    await serving.run_load(base, model, warm, concurrency=2, **load)
    runs = []
    for level in args.concurrency:
        run = await serving.run_load(base, model, level_requests(level, args), concurrency=level, **load)
        runs.append(run)
        s = summary(run)
        print(f"  concurrency {level}: {run['completed']} ok, {run['failed']} failed, "
              f"{s['output_tok_s']:.1f} tok/s, TTFT p50/p90 {_ms(s['ttft_p50_s'])}/{_ms(s['ttft_p90_s'])} ms, "
              f"ITL p50/p90 {_ms(s['itl_p50_s'])}/{_ms(s['itl_p90_s'])} ms", file=sys.stderr, flush=True)
    return runs


def summary(run: dict) -> dict:
    out = {"concurrency": run["concurrency"], "completed": run["completed"], "failed": run["failed"],
           "mean_output_tokens": run["mean_output_tokens"], "mean_prompt_tokens": run["mean_prompt_tokens"]}
    for name, (key, q) in FIGURES.items():
        out[name] = run[key] if q is None else run[key][q]
    return out


def ratios(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """Per level, each figure of `ours` over the same of `theirs` (above 1 is better for tok/s,
    below 1 better for the latencies); None where either is missing or the peer's is 0."""
    out = []
    for a, b in zip(map(summary, ours), map(summary, theirs)):
        if a["concurrency"] != b["concurrency"]:
            raise ValueError(f"levels differ: {a['concurrency']} against {b['concurrency']}")
        out.append({"concurrency": a["concurrency"],
                    **{k: a[k] / b[k] if a[k] is not None and b[k] else None for k in FIGURES}})
    return out


def compare(results: dict[str, dict]) -> dict[str, list[dict]]:
    """Every Matinee run over every peer run, keyed "matinee-X/vllm-Y" (or ".../llamacpp-tN")."""
    ours = [k for k in results if k.startswith("matinee")]
    theirs = [k for k in results if not k.startswith("matinee")]
    return {f"{a}/{b}": ratios(results[a]["runs"], results[b]["runs"]) for a in ours for b in theirs}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if peers.vllm_processes():
        sys.exit(f"vLLM is already running ({peers.vllm_processes()}): one server at a time")
    results = {}
    for srv in servers(args):
        t0 = time.monotonic()
        print(f"--- {srv.label}: starting ({' '.join(srv.cmd)})", file=sys.stderr, flush=True)
        with srv:
            ready_s = time.monotonic() - t0
            print(f"    ready after {ready_s:.0f} s", file=sys.stderr, flush=True)
            runs = asyncio.run(sweep(srv.url, peers.SERVED_NAME, args))
        short = [r["concurrency"] for r in runs if r["failed"] or r["mean_output_tokens"] != args.output_len]
        if short:
            print(f"    WARNING: failed requests or short outputs at concurrency {short}", file=sys.stderr)
        results[srv.label] = {"cmd": srv.cmd, "ready_s": ready_s, "runs": runs,
                              "summary": [summary(r) for r in runs], "leftover_pids_stopped": srv.leftovers}
    left = peers.vllm_processes()
    out = {"workload": {"input_len": args.input_len, "output_len": args.output_len, "ignore_eos": True,
                        "concurrency": args.concurrency, "min_requests": args.min_requests,
                        "vllm_omp_bind": args.vllm_omp_bind},
           "results": results, "ratios": compare(results), "vllm_processes_left": left}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps({"summary": {k: r["summary"] for k, r in results.items()}, "ratios": out["ratios"]}, indent=2))
    if left:
        sys.exit(f"vLLM processes left running: {left}")
    return out


if __name__ == "__main__":
    main()
