"""Prefill/decode disaggregation against colocated engines: `python -m bench.disagg --json`.

Two engine processes either way, one after the other on this machine: 2 colocated engines behind
the KV-aware router, then 1 prefill + 1 decode engine. The same workload hits each: `--streams`
background requests that decode long outputs from short prompts (replaced as they finish), and
long prompts arriving at `--rate` per second that want only a few tokens. Reports the background
streams' inter-token latency p50/p99, the long prompts' TTFT p50/p90, goodput (requests per second
whose TTFT and mean inter-token latency both meet the objectives; also with each request's own
p99 gap in place of its mean), the long prompts' wait for their second token (on the pair, the
handoff's tail: what was not sent ahead while the prompt was computed) and, for the pair, what a
handoff costs per token moved (bytes, and ms once the first token is out, over the bytes left to send
then), from the engines' own counters.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time

import aiohttp

from bench.cluster import Processes, StreamError, _engines_seen, _free_port, _pct, sse_events

SECRET = "bench-disagg-secret"
BLOCK = 16


async def _stream(session, base: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed request: its TTFT and the gaps between its tokens. Every chunk is a token (one
    whose text is held back, half a character, comes with empty text), as vLLM's benchmark counts."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    times: list[float] = []
    async with session.post(base + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"ok": False, "error": f"HTTP {r.status}"}
        try:
            async for ev in sse_events(r):
                if ev.get("choices"):
                    times.append(time.perf_counter())
        except StreamError as e:
            return {"ok": False, "error": str(e)}
    if not times:
        return {"ok": False, "error": "no tokens"}
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ok": True, "ttft": times[0] - start, "gaps": gaps,
            "tpot": sum(gaps) / len(gaps) if gaps else 0.0, "itl_p99": _pct(gaps, 0.99) if gaps else 0.0}


async def _workload(session, base: str, args) -> dict:
    # One generator each: the arrivals (and long prompts) are the same whatever the streams drew.
    rng, arrivals_rng = random.Random(args.seed), random.Random(args.seed + 1)
    hi = args.vocab - 1
    stop_at = time.perf_counter() + args.duration
    background: list[dict] = []
    arrivals: list[dict] = []

    async def decode_stream() -> None:
        while time.perf_counter() < stop_at:
            prompt = [rng.randrange(100, hi) for _ in range(args.stream_prompt)]
            background.append(await _stream(session, base, prompt, args.stream_tokens))

    async def long_prompts() -> None:
        tasks = []
        await asyncio.sleep(args.warmup)
        while time.perf_counter() < stop_at:
            prompt = [arrivals_rng.randrange(100, hi) for _ in range(args.long_prompt)]
            tasks.append(asyncio.create_task(_stream(session, base, prompt, args.long_tokens)))
            # The next arrival, or the end of the load: a wait never outlasts the run.
            await asyncio.sleep(min(arrivals_rng.expovariate(args.rate), max(stop_at - time.perf_counter(), 0.0)))
        arrivals.extend(await asyncio.gather(*tasks))

    started = time.perf_counter()
    await asyncio.gather(long_prompts(), *(decode_stream() for _ in range(args.streams)))
    elapsed = time.perf_counter() - started
    ok_bg = [r for r in background if r["ok"]]
    ok_long = [r for r in arrivals if r["ok"]]
    gaps = [g for r in ok_bg for g in r["gaps"]]
    ttfts = [r["ttft"] for r in ok_long]
    second_gaps = [r["gaps"][0] for r in ok_long if r["gaps"]]   # what the pair's handoff adds after the first token
    done = ok_bg + ok_long
    good = [r for r in done if r["ttft"] <= args.ttft_slo and r["tpot"] <= args.itl_slo]
    # The same TTFT objective with the ITL one on each request's own p99 gap instead of its mean.
    good_p99 = [r for r in done if r["ttft"] <= args.ttft_slo and r["itl_p99"] <= args.itl_slo]
    bg_ttfts = [r["ttft"] for r in ok_bg]
    good_ids = {id(r) for r in good}
    return {"background_requests": len(background), "long_requests": len(arrivals),
            "failed": len(background) + len(arrivals) - len(ok_bg) - len(ok_long),
            "itl_p50_ms": 1000 * _pct(gaps, 0.5), "itl_p99_ms": 1000 * _pct(gaps, 0.99),
            "itl_p90_ms": 1000 * _pct(gaps, 0.9), "itl_p95_ms": 1000 * _pct(gaps, 0.95),
            "itl_p999_ms": 1000 * _pct(gaps, 0.999),
            "long_ttft_p50_s": _pct(ttfts, 0.5), "long_ttft_p90_s": _pct(ttfts, 0.9),
            "long_second_token_p50_ms": 1000 * _pct(second_gaps, 0.5),
            "long_second_token_p90_ms": 1000 * _pct(second_gaps, 0.9),
            "goodput_rps": len(good) / elapsed, "good": len(good), "elapsed_s": elapsed,
            "goodput_p99_rps": len(good_p99) / elapsed,
            # Where the good requests come from, and the background streams' own TTFT.
            "good_background": sum(id(r) in good_ids for r in ok_bg),
            "good_long": sum(id(r) in good_ids for r in ok_long),
            "background_ttft_p50_s": _pct(bg_ttfts, 0.5), "background_ttft_p90_s": _pct(bg_ttfts, 0.9),
            "output_tok_s": (sum(len(r["gaps"]) + 1 for r in ok_bg + ok_long)) / elapsed}


async def _metrics(session, urls: list[str]) -> dict[str, float]:
    """The engines' handoff counters, summed over their own /metrics."""
    out: dict[str, float] = {}
    for url in urls:
        async with session.get(url + "/metrics") as r:
            text = await r.text()
        for line in text.splitlines():
            if line.startswith("matinee_kv_transfer_") or line.startswith("matinee_kv_handoffs_"):
                name, value = line.rsplit(" ", 1)
                out[name] = out.get(name, 0.0) + float(value)
    return out


async def _run(args, base: str, engines: list[str]) -> dict:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        deadline = time.monotonic() + args.startup_timeout
        while await _engines_seen(session, base) < len(engines):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not come up; see the logs")
            await asyncio.sleep(1.0)
        await _stream(session, base, [101, 102, 103], 4)   # every path warmed once
        await _stream(session, base, [104, 105, 106], 4)
        result = await _workload(session, base, args)
        result["metrics"] = await _metrics(session, engines)
        return result


def _cluster(args, roles: list[str], label: str) -> dict:
    logdir = tempfile.mkdtemp(prefix=f"bench-disagg-{label}-")
    procs = Processes(logdir)
    env = {"MATINEE_CLUSTER_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    serve = [sys.executable, "-m", "gateway.cli", "serve"]   # `matinee serve`
    model = ["--model", args.model] if args.model else []
    metrics_ports = [_free_port() for _ in roles]
    try:
        redis_url = procs.start_redis()
        for i, role in enumerate(roles):
            procs.start(f"{role}-{i}", [*serve, "--role", role, *model, "--dtype", args.dtype,
                                        "--kv-cache-dtype", args.kv_cache_dtype,
                                        "--metrics-port", str(metrics_ports[i]),
                                        "--num-threads", "1", "--num-blocks", str(args.num_blocks),
                                        "--max-num-batched-tokens", str(args.step_tokens),
                                        "--redis-url", redis_url, "--listen-port", str(_free_port()),
                                        "--engine-id", f"{role}-{i}"], env)
        port = _free_port()
        local = ([] if args.local_prefill_tokens is None
                 else ["--local-prefill-tokens", str(args.local_prefill_tokens)])
        procs.start("gateway", [*serve, "--role", "gateway", *model, "--redis-url", redis_url,
                                "--port", str(port), "--routing", "kv", *local], env)
        result = asyncio.run(_run(args, f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{p}" for p in metrics_ports]))
    finally:
        procs.stop()
    result["logs"] = logdir
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--vocab", type=int, default=49152, help="prompt token ids are drawn below this")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto", help="both setups' engines (auto: the model's dtype)")
    p.add_argument("--streams", type=int, default=6, help="background decode streams, kept running")
    p.add_argument("--stream-prompt", type=int, default=24)
    p.add_argument("--stream-tokens", type=int, default=96)
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--long-tokens", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.25, help="long prompts per second (Poisson)")
    p.add_argument("--duration", type=float, default=45.0, help="seconds of load per setup")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of background alone first")
    p.add_argument("--ttft-slo", type=float, default=4.0, help="seconds")
    p.add_argument("--itl-slo", type=float, default=0.2, help="seconds, the mean gap of one request")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--step-tokens", type=int, default=512, help="--max-num-batched-tokens")
    p.add_argument("--local-prefill-tokens", type=int, default=None,
                   help="the gateway's flag (default: its own): prompts this short run whole on the decode engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("bench.disagg needs redis-server", file=sys.stderr)
        return 2
    print("bench.disagg: 2 colocated engines...", file=sys.stderr, flush=True)
    colocated = _cluster(args, ["engine", "engine"], "colocated")
    print("bench.disagg: 1 prefill + 1 decode engine...", file=sys.stderr, flush=True)
    disagg = _cluster(args, ["prefill", "decode"], "disagg")
    m = disagg["metrics"]
    tokens = m.get("matinee_kv_transfer_blocks_total", 0.0) * BLOCK
    sent = m.get("matinee_kv_transfer_bytes_total", 0.0)
    # The transfer time counts from the first token: it covers the bytes that did not go ahead of it
    # (whole blocks of earlier chunks, and the layers the forward wrote), in tokens' worth.
    tokens_after = tokens * (1 - m.get("matinee_kv_transfer_bytes_ahead_total", 0.0) / sent) if sent else 0.0
    seconds, handed = m.get("matinee_kv_transfer_seconds_total", 0.0), m.get("matinee_kv_handoffs_sent_total", 0.0)
    result = {
        "colocated": colocated, "disagg": disagg,
        "itl_p99_ratio": colocated["itl_p99_ms"] / disagg["itl_p99_ms"] if disagg["itl_p99_ms"] else float("nan"),
        "goodput_ratio": disagg["goodput_rps"] / colocated["goodput_rps"] if colocated["goodput_rps"] else float("nan"),
        "goodput_p99_ratio": (disagg["goodput_p99_rps"] / colocated["goodput_p99_rps"]
                              if colocated["goodput_p99_rps"] else float("nan")),
        "transfer_bytes_per_token": sent / tokens if tokens else float("nan"),
        "transfer_ms_per_token": 1000 * seconds / tokens_after if tokens_after else float("nan"),
        "transfer_ahead_frac": 1 - tokens_after / tokens if tokens else float("nan"),
        # What a handed-over request waits for its transfer once its first token is out.
        "transfer_wait_ms_per_handoff": 1000 * seconds / handed if handed else float("nan"),
        "workload": {k: getattr(args, k) for k in ("streams", "stream_prompt", "stream_tokens", "long_prompt",
                                                    "long_tokens", "rate", "duration", "ttft_slo", "itl_slo",
                                                    "num_blocks", "step_tokens", "dtype", "kv_cache_dtype",
                                                    "local_prefill_tokens")},
        "cpu": os.cpu_count()}
    failed = m.get("matinee_kv_handoffs_failed_total", 0.0)
    if failed:   # each was prefilled again elsewhere: the pair's figures are not the pair's alone
        print(f"bench.disagg: {failed:.0f} of {failed + handed:.0f} handoffs failed; see {disagg['logs']}",
              file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        for label, r in (("2 colocated", colocated), ("1P + 1D", disagg)):
            print(f"{label:>12}: ITL p50 {r['itl_p50_ms']:.1f} ms p99 {r['itl_p99_ms']:.1f} ms, long TTFT p50 "
                  f"{r['long_ttft_p50_s']:.2f}s p90 {r['long_ttft_p90_s']:.2f}s, its second token after "
                  f"{r['long_second_token_p50_ms']:.0f} ms (p50), goodput {r['goodput_rps']:.2f} req/s "
                  f"({r['goodput_p99_rps']:.2f} on p99 gaps), failed {r['failed']}")
        print(f"ITL p99 colocated / disagg {result['itl_p99_ratio']:.2f}x, goodput disagg / colocated "
              f"{result['goodput_ratio']:.2f}x; transfer {result['transfer_bytes_per_token']:.0f} B and "
              f"{result['transfer_ms_per_token']:.4f} ms per token after the first token "
              f"({100 * result['transfer_ahead_frac']:.0f}% of the bytes went ahead; "
              f"{result['transfer_wait_ms_per_handoff']:.1f} ms from the first token to the commit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
