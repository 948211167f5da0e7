"""Load generator for any OpenAI-compatible server: `python -m bench.serving --url URL ...`.

Poisson arrivals at each rate of a sweep (or a fixed concurrency), streaming chat requests;
reports TTFT, TPOT, ITL and end-to-end latency percentiles, req/s, output tok/s and goodput
under SLOs, as JSON, and a PNG of latency against load. It never reads server internals.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from bench.png_plot import line_chart
from bench.serving_data import DATASETS, Request, make_requests


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def send(session: aiohttp.ClientSession, base: str, model: str, req: Request,
               headers: dict, ignore_eos: bool) -> Result:
    """One streaming request: a completion of `req.prompt_ids` if set, else a chat completion."""
    body = {"model": model, "max_tokens": req.max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    if req.prompt_ids is not None:
        url, body["prompt"] = f"{base}/v1/completions", req.prompt_ids
    else:
        url, body["messages"] = f"{base}/v1/chat/completions", req.messages
    if ignore_eos:
        body["ignore_eos"] = True
    res = Result()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload.strip() == b"[DONE]":
                        continue
                    obj = json.loads(payload)
                    if "error" in obj:
                        res.error = str(obj["error"])[:200]
                        return res
                    if obj.get("usage"):
                        res.output_tokens = obj["usage"].get("completion_tokens", 0)
                        res.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    for ch in obj.get("choices") or []:
                        if (ch.get("delta") or {}).get("content") or ch.get("text"):
                            now = time.perf_counter()
                            if chunks == 0:
                                res.ttft = now - start
                            else:
                                res.itl.append(now - last)
                            last = now
                            chunks += 1
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no content received"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(p: float) -> float:   # linear interpolation, as numpy's default
        k = (len(s) - 1) * p
        f, c = math.floor(k), math.ceil(k)
        return s[f] + (s[c] - s[f]) * (k - f)

    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


async def run_load(base: str, model: str, reqs: list[Request], *, rate: float | None,
                   concurrency: int | None, headers: dict, ignore_eos: bool, seed: int,
                   slo_ttft: float, slo_tpot: float) -> dict:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    limit = concurrency or 0
    # A connection per request, for every engine alike: llama-server drops a kept-alive connection as the next
    # request arrives on it (one in two after a 4.5 s stream, on 2026-12-08's build), and a reused connection then
    # failed that request ("Server disconnected"): the peer's failures were the client's.
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=limit, force_close=True)) as session:
        sem = asyncio.Semaphore(concurrency) if concurrency else None

        async def one(r: Request) -> Result:
            if sem is None:
                return await send(session, base, model, r, headers, ignore_eos)
            async with sem:
                return await send(session, base, model, r, headers, ignore_eos)

        start = time.perf_counter()
        tasks = []
        for r in reqs:
            tasks.append(asyncio.create_task(one(r)))
            if rate is not None and math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "rate": rate if rate is None or math.isfinite(rate) else "inf",
        "concurrency": concurrency,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "req_s": len(ok) / duration, "output_tok_s": out_tokens / duration,
        "goodput_req_s": len(good) / duration,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / max(1, len(ok)),
        "mean_output_tokens": out_tokens / max(1, len(ok)),
    }


def plot(runs_by_label: dict[str, list[dict]], path: str) -> None:
    series = {f"{label} P90 TPOT MS": [(r["req_s"], r["tpot_s"]["p90"] * 1000) for r in runs
                                       if r["tpot_s"]["p90"] is not None]
              for label, runs in runs_by_label.items()}
    with open(path, "wb") as f:
        f.write(line_chart(series, "LATENCY AGAINST LOAD", "REQ/S", "P90 TPOT (MS)"))


def _floats(text: str) -> list[float]:
    return [math.inf if x.strip() in ("inf", "max") else float(x) for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--label", default=None, help="name of this server in the plot and JSON")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128, help="prompt words (mean)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (mean)")
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512, help="shared system prompt words")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rates", type=_floats, default=None, help="Poisson rates (req/s), e.g. 1,2,4,inf")
    g.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="fixed concurrency levels, e.g. 1,8,32")
    p.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT (s)")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO on TPOT (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG of p90 TPOT against req/s here")
    p.add_argument("--compare", nargs="*", default=[], help="earlier JSON results to plot alongside")
    return p


async def _resolve_model(base: str, headers: dict) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/v1/models", headers=headers) as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]


async def amain(args: argparse.Namespace) -> dict:
    base = args.url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or await _resolve_model(base, headers)
    reqs = make_requests(args.dataset, args.num_prompts, input_len=args.input_len,
                         output_len=args.output_len, range_ratio=args.range_ratio,
                         num_prefixes=args.num_prefixes, prefix_len=args.prefix_len, seed=args.seed)
    levels = ([("rate", r) for r in args.rates] if args.rates else
              [("concurrency", c) for c in (args.concurrency or [8])])
    runs = []
    for kind, level in levels:
        run = await run_load(base, model, reqs,
                             rate=level if kind == "rate" else None,
                             concurrency=level if kind == "concurrency" else None,
                             headers=headers, ignore_eos=not args.no_ignore_eos, seed=args.seed,
                             slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot)
        runs.append(run)
        t, e = run["tpot_s"], run["ttft_s"]
        print(f"{kind}={level}: {run['completed']} ok, {run['failed']} failed, "
              f"{run['req_s']:.2f} req/s, {run['output_tok_s']:.1f} tok/s, "
              f"TTFT p50/p90 {_ms(e['p50'])}/{_ms(e['p90'])} ms, "
              f"TPOT p50/p90 {_ms(t['p50'])}/{_ms(t['p90'])} ms, goodput {run['goodput_req_s']:.2f} req/s",
              file=sys.stderr, flush=True)
    return {"url": base, "label": args.label or base, "model": model, "dataset": args.dataset,
            "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
            "runs": runs}


def save_json(result: dict, path: str | None) -> bool:
    """Writes the result to `path` as indented JSON; False where no path was given."""
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(result, indent=2))
    return bool(path)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(amain(args))
    if not save_json(result, args.json):
        print(json.dumps(result, indent=2))
    if args.plot:
        by_label = {result["label"]: result["runs"]}
        for path in args.compare:
            with open(path) as f:
                other = json.load(f)
            by_label[other.get("label", path)] = other["runs"]
        plot(by_label, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
