"""Tensor parallelism on the CPU: `--tensor-parallel-size 2`, each rank on its own half of the cores,
against one process on all of them, through the whole engine (`actors.LLM`).

    python -m bench.tensor_parallel --model PATH [--prompt-len 512] [--decode-tokens 64] [--batch 8]
                                    [--repeats 3] [--dtype auto] [--all-reduce gloo shm] [--json PATH]

For each configuration (TP=1 on every core this process may use, then TP=2 with the cores split in two
contiguous groups, one rank on each: on two cores, one core each; a TP=2 run for each `--all-reduce`
choice, gloo's or shared memory's), each in a fresh process of its own after the one before has ended
(never two engines at once), it measures:

- decode inter-token latency of one stream and of `--batch` streams (the engine's own ITL: a step's gap
  per token, the mean over the run; each stream's prompt 17 tokens, all but the last already in the prefix
  cache, so every step of the run is a decode step; `--decode-tokens` generated);
- the prefill of one `--prompt-len`-token prompt in one step (the median wall time of a request for one
  token: its time to first token alone on the engine);
- the all-reduce's share of the step: rank 0's time inside its all-reduces (the o and down projections'
  and the embedding's; TensorParallel keeps the timer, the engine's stats carry it as `all_reduce_s`)
  over the engine's step time (`step_s`: planning a step to handling its result), for the decode runs
  and for the prefill. It is measured on
  rank 0's host clock, so it holds the transfer and any wait for the slower rank. `collective_share`
  also counts the LM head's vocabulary gather and the plan's broadcasts.

Prints a table, the ratios TP2/TP1 (above 1: TP=2 slower) and what the TP=2 step is made of; `--json`
writes every figure. The prefilled prompts are random, so none is found in the prefix cache.

On two cores of one socket this shows what the split costs: both ranks read their halves of the weights
over the same memory bus TP=1 reads them over, each at one core's pace, and add two all-reduces a layer;
TP=1 also runs the fused C layer loop that a shard cannot (a rank's layers run op by op). On a two-socket
machine each rank would have its own memory bandwidth, so a memory-bound decode step's compute could
nearly halve while the collectives stay (and cross the socket link): the printed split of the TP=2 step
into its all-reduce and the rest is what to reason from. Asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

BLOCK = 16
DECODE_PROMPT_LEN = BLOCK + 1   # a decode stream's prompt: one block from the prefix cache, one token computed


def run_configuration(model: str, tp: int, opts: dict, all_reduce: str = "auto") -> dict:
    """One engine of `tp` ranks measured in a fresh process of its own, which ends (and its ranks with it)
    before this returns: nothing one configuration leaves in a process (threads, an OpenMP team, a heap)
    is measured with the other."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measure, model, tp, opts, all_reduce).result()


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def _delta(before, after) -> dict:
    itl_count = sum(after.itl_buckets) - sum(before.itl_buckets)
    return {"steps": after.steps - before.steps, "step_s": after.step_s - before.step_s,
            "forward_s": after.forward_s - before.forward_s, "all_reduce_s": after.all_reduce_s - before.all_reduce_s,
            "collective_s": after.collective_s - before.collective_s,
            "cached_tokens": after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
            "itl_count": itl_count, "itl_sum": after.itl_sum - before.itl_sum}


def _shares(d: dict) -> dict:
    """Per-step times and the collectives' shares of the step from a stats delta."""
    steps, step_s = max(d["steps"], 1), d["step_s"]
    return {"steps": d["steps"], "cached_tokens": d["cached_tokens"], "step_ms": step_s / steps * 1e3, "forward_ms": d["forward_s"] / steps * 1e3,
            "all_reduce_ms": d["all_reduce_s"] / steps * 1e3,
            "all_reduce_share": d["all_reduce_s"] / step_s if step_s > 0 else 0.0,
            "collective_share": d["collective_s"] / step_s if step_s > 0 else 0.0}


def _measure(model: str, tp: int, opts: dict, all_reduce: str) -> dict:
    from actors import LLM, SamplingParams

    prompt_len, decode_tokens, batch = opts["prompt_len"], opts["decode_tokens"], opts["batch"]
    decode_blocks = batch * (_blocks(DECODE_PROMPT_LEN + decode_tokens + 2) + 2)   # + a burst's lookahead
    num_blocks = max(_blocks(prompt_len + 2) + 2, decode_blocks) + 8
    cores = len(os.sched_getaffinity(0))
    rng = random.Random(opts["seed"])
    t_start = time.perf_counter()
    with LLM(model, dtype=opts["dtype"], kernels=opts["kernels"], quantization=opts["quantization"],
             tensor_parallel_size=tp, tp_all_reduce=all_reduce, block_size=BLOCK, num_blocks=num_blocks,
             max_num_seqs=max(batch, 1), max_num_batched_tokens=max(prompt_len, batch * DECODE_PROMPT_LEN),
             seed=opts["seed"]) as llm:
        load_s = time.perf_counter() - t_start
        vocab = llm.engine.model_config.vocab_size
        hi = min(vocab, 32000) - 1   # clear of the special tokens a large vocabulary keeps at its end

        def prompt(n: int) -> list[int]:
            return [rng.randrange(min(100, hi - 1), hi) for _ in range(n)]

        def timed(prompts: list[list[int]], max_tokens: int) -> tuple[float, dict]:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            before = llm.stats()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            after = llm.stats()
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != [max_tokens] * len(prompts):
                raise RuntimeError(f"TP={tp}: generated {got} tokens, expected {max_tokens} each")
            return wall, _delta(before, after)

        # Warm-up: a prompt of the measured length and a short decode of the batch (prompts never seen again).
        timed([prompt(prompt_len)], 2)
        timed([prompt(DECODE_PROMPT_LEN) for _ in range(batch)], 4)

        walls, total = [], None
        for _ in range(opts["repeats"]):
            wall, d = timed([prompt(prompt_len)], 1)
            walls.append(wall)
            total = d if total is None else {k: total[k] + d[k] for k in d}
        prefill = {"prompt_len": prompt_len, "ms": statistics.median(walls) * 1e3, "best_ms": min(walls) * 1e3,
                   "tokens_per_s": prompt_len / statistics.median(walls), **_shares(total)}

        decode = {}
        for streams in sorted({1, batch}):
            prompts = [prompt(DECODE_PROMPT_LEN) for _ in range(streams)]
            timed(prompts, 1)   # their KV into the prefix cache: the run below computes each one's last token
            _, d = timed(prompts, 1 + decode_tokens)
            itl = d["itl_sum"] / d["itl_count"] if d["itl_count"] else 0.0
            decode[str(streams)] = {"streams": streams, "itl_ms": itl * 1e3,
                                    "tokens_per_s": streams * decode_tokens / itl if itl else 0.0, **_shares(d)}
        weight_bytes = llm.stats().weight_bytes
    return {"tensor_parallel_size": tp, "all_reduce": all_reduce if tp > 1 else None, "cores": cores,
            "threads_per_rank": max(1, cores // tp),
            "load_s": load_s, "weight_bytes_rank0": weight_bytes, "prefill": prefill, "decode": decode}


def _ratios(one: dict, two: dict) -> dict:
    out = {"prefill_ms": two["prefill"]["ms"] / one["prefill"]["ms"]}
    for key, d in two["decode"].items():
        out[f"itl_ms_{key}"] = d["itl_ms"] / one["decode"][key]["itl_ms"]
    return out


def _table(runs: dict) -> str:
    """A column per configuration, then each TP=2 one over TP=1 (above 1: slower)."""
    one, twos = runs["tp1"], {k: v for k, v in runs.items() if k != "tp1"}
    rows = [("prefill ms", "prefill", "ms"), ("prefill all-reduce share", "prefill", "all_reduce_share")]
    for key in one["decode"]:
        rows += [(f"decode ITL ms, {key} stream(s)", ("decode", key), "itl_ms"),
                 (f"decode all-reduce share, {key}", ("decode", key), "all_reduce_share")]
    names = ["TP=1"] + [f"TP=2 {r['all_reduce']}" for r in twos.values()]
    names += [f"{n}/TP=1" for n in names[1:]]
    lines = [f"{'':34}" + "".join(f"{n:>15}" for n in names)]
    for label, where, field in rows:
        values = [_at(r, where)[field] for r in (one, *twos.values())]
        fmt = "{:15.1%}" if "share" in field else "{:15.2f}"
        ratios = "" if "share" in field else "".join(f"{v / values[0]:15.2f}" for v in values[1:])
        lines.append(f"{label:34}" + "".join(fmt.format(v) for v in values) + ratios)
    return "\n".join(lines)


def _at(run: dict, where):
    return run[where] if isinstance(where, str) else run[where[0]][where[1]]


def _summary(two: dict) -> str:
    """What a TP=2 step is made of, for reasoning about a machine where each rank has its own memory."""
    lines = []
    for label, s in [("prefill", two["prefill"])] + [(f"decode, {k} stream(s)", d) for k, d in two["decode"].items()]:
        rest = s["step_ms"] - s["all_reduce_ms"]
        lines.append(f"TP=2 {two['all_reduce']} {label}: a step of {s['step_ms']:.2f} ms, {s['all_reduce_ms']:.2f} ms "
                     f"({s['all_reduce_share']:.1%}) inside the all-reduces (all collectives: "
                     f"{s['collective_share']:.1%}), {rest:.2f} ms the rest")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF folder or GGUF file (heads divisible by 2)")
    ap.add_argument("--prompt-len", type=int, default=512, help="the prefilled prompt's tokens")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens each decode stream generates")
    ap.add_argument("--batch", type=int, default=8, help="streams of the batched decode (also run: 1)")
    ap.add_argument("--repeats", type=int, default=3, help="prefills timed (the median reported)")
    ap.add_argument("--dtype", default="auto", help="resolved once, and the same for every configuration")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--all-reduce", nargs="+", default=["auto"], choices=["auto", "shm", "gloo"],
                    help="the TP=2 ranks' all-reduce (--tp-all-reduce): a TP=2 run for each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="PATH", help="write every figure here as JSON")
    args = ap.parse_args(argv)
    if min(args.prompt_len, args.decode_tokens, args.batch, args.repeats) < 1:
        ap.error("--prompt-len, --decode-tokens, --batch and --repeats must be positive")

    from actors.config import EngineConfig

    # `auto` resolved here, once: both configurations run the same dtype whatever a probe would say.
    dtype = EngineConfig(model=args.model, dtype=args.dtype, kernels=args.kernels).resolved_dtype()
    opts = dict(prompt_len=args.prompt_len, decode_tokens=args.decode_tokens, batch=args.batch,
                repeats=args.repeats, dtype=dtype, kernels=args.kernels, quantization=args.quantization,
                seed=args.seed)
    # One after the other: each starts once the one before's processes have ended.
    runs = {"tp1": run_configuration(args.model, 1, opts)}
    for choice in dict.fromkeys(args.all_reduce):
        runs[f"tp2_{choice}"] = run_configuration(args.model, 2, opts, choice)
    ratios = {run["all_reduce"]: _ratios(runs["tp1"], run) for key, run in runs.items() if key != "tp1"}
    out = {"model": os.path.basename(os.path.normpath(args.model)), "cores": len(os.sched_getaffinity(0)),
           "decode_prompt_len": DECODE_PROMPT_LEN, **opts, **runs, "ratios_tp2_over_tp1": ratios}
    threads = runs[f"tp2_{args.all_reduce[0]}"]["threads_per_rank"]
    print(f"{out['model']}, {dtype}, {out['cores']} cores: TP=1 on all of them, TP=2 on {threads} each")
    print(_table(runs))
    for key, run in runs.items():
        if key != "tp1":
            print(_summary(run))
    print("On one socket both ranks share its memory bandwidth; with a socket each, the rest of a "
          "memory-bound step could shrink toward half while the all-reduce part stays.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
