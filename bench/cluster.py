"""Cluster benchmark: `python -m bench.cluster --json`.

Starts a redis-server, two engines and two gateways on this machine (one gateway routes by the
prefix index, the other round robin, both over the same engines) and sends each the same kind
of shared-prefix workload: tenants with long system prompts, short questions, Poisson arrivals.
Each phase uses its own tenants, so neither inherits the other's cache. Reports the prefix hit
rate (system-prompt tokens served from the cache) and TTFT p50/p90 per routing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp

SECRET = "bench-cluster-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


class Processes:
    def __init__(self, logdir: str):
        self.logdir, self.procs = logdir, []

    def start(self, name: str, argv: list[str], env: dict | None = None) -> None:
        log = open(os.path.join(self.logdir, name + ".log"), "ab")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, **(env or {})}))
        log.close()

    def start_redis(self) -> str:
        """A redis-server of this run's own on a free port, keeping nothing on disk; its URL."""
        port = _free_port()
        self.start("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"])
        return f"redis://127.0.0.1:{port}/0"

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


async def _engines_seen(session: aiohttp.ClientSession, base: str) -> int:
    try:
        async with session.get(base + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("matinee_engines "):
                    return int(float(line.split()[1]))
    except aiohttp.ClientError:
        pass
    return 0


async def gateways_up(session: aiohttp.ClientSession, bases, timeout_s: float, engines: int = 2) -> None:
    """Until each gateway at `bases` sees `engines` engines; RuntimeError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for base in bases:
        while await _engines_seen(session, base) < engines:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not come up in {timeout_s} s; see the logs")
            await asyncio.sleep(1.0)


class StreamError(Exception):
    """An error event inside a stream that began with 200."""


async def sse_events(response):
    """The JSON events of an OpenAI-style SSE response, up to `data: [DONE]`; an error event raises."""
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise StreamError(str(ev["error"]))
        yield ev


async def _one(session, base: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, cached = None, 0
    async with session.post(base + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"ok": False, "error": f"HTTP {r.status}: {await r.text()}"}
        try:
            async for ev in sse_events(r):
                if ev.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
                if ev.get("usage"):
                    cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
        except StreamError as e:
            return {"ok": False, "error": str(e)}
    return {"ok": ttft is not None, "ttft": ttft, "cached": cached}


async def _phase(session, base: str, args, seed: int) -> dict:
    rng = random.Random(seed)
    vocab_hi = args.vocab - 1
    tenants = [[rng.randrange(100, vocab_hi) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    for t in tenants:   # each system prompt computed once, wherever routing sends it
        await _one(session, base, t + [rng.randrange(100, vocab_hi) for _ in range(8)], 1)
    await asyncio.sleep(0.5)
    tasks = []
    for _ in range(args.requests):
        await asyncio.sleep(rng.expovariate(args.rate))
        question = [rng.randrange(100, vocab_hi) for _ in range(rng.randrange(8, 33))]
        tasks.append(asyncio.create_task(_one(session, base, rng.choice(tenants) + question, args.max_tokens)))
    results = await asyncio.gather(*tasks)
    ok = [r for r in results if r["ok"]]
    ttfts = [r["ttft"] for r in ok]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "hit_rate": sum(min(r["cached"], args.system_tokens) for r in ok) / max(1, len(ok) * args.system_tokens),
            "full_hits": sum(r["cached"] >= args.system_tokens - 15 for r in ok) / max(1, len(ok)),
            "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p90_s": _pct(ttfts, 0.9)}


async def _run(args, gateways: dict[str, str]) -> dict:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await gateways_up(session, gateways.values(), args.startup_timeout)
        out = {}
        for i, (routing, base) in enumerate(gateways.items()):
            print(f"bench.cluster: {routing} routing...", file=sys.stderr, flush=True)
            out[routing] = await _phase(session, base, args, seed=1000 + i)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--vocab", type=int, default=49152, help="prompt token ids are drawn below this")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--requests", type=int, default=40, help="per routing")
    p.add_argument("--rate", type=float, default=0.4, help="Poisson arrivals per second")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=400,
                   help="KV blocks per engine: room for about 5 of the 8 system prompts")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("bench.cluster needs redis-server", file=sys.stderr)
        return 2
    logdir = tempfile.mkdtemp(prefix="bench-cluster-")
    procs = Processes(logdir)
    env = {"MATINEE_CLUSTER_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    serve = [sys.executable, "-m", "gateway.cli", "serve"]   # `matinee serve`
    model = ["--model", args.model] if args.model else []
    try:
        redis_url = procs.start_redis()
        for i in range(2):
            port = _free_port()
            procs.start(f"engine-{i}", [*serve, "--role", "engine", *model, "--dtype", args.dtype,
                                        "--num-blocks", str(args.num_blocks), "--redis-url", redis_url,
                                        "--listen-port", str(port), "--engine-id", f"engine-{i}"], env)
        gateways = {}
        for routing in ("kv", "round_robin"):
            port = _free_port()
            procs.start(f"gateway-{routing}", [*serve, "--role", "gateway", *model, "--redis-url", redis_url,
                                               "--port", str(port), "--routing", routing], env)
            gateways[routing] = f"http://127.0.0.1:{port}"
        phases = asyncio.run(_run(args, gateways))
    finally:
        procs.stop()
    kv, rr = phases["kv"], phases["round_robin"]
    result = {"kv_hit_rate": kv["hit_rate"], "rr_hit_rate": rr["hit_rate"],
              "kv_ttft_p50_s": kv["ttft_p50_s"], "kv_ttft_p90_s": kv["ttft_p90_s"],
              "rr_ttft_p50_s": rr["ttft_p50_s"], "rr_ttft_p90_s": rr["ttft_p90_s"],
              "ttft_p90_ratio": rr["ttft_p90_s"] / kv["ttft_p90_s"] if kv["ttft_p90_s"] else float("nan"),
              "kv": kv, "round_robin": rr, "logs": logdir,
              "workload": {k: getattr(args, k) for k in ("tenants", "system_tokens", "requests", "rate",
                                                          "max_tokens", "num_blocks", "dtype")}}
    if args.json:
        print(json.dumps(result))
    else:
        for routing, r in (("kv", kv), ("round robin", rr)):
            print(f"{routing:>12}: hit rate {r['hit_rate']:.1%} (full hits {r['full_hits']:.1%}), "
                  f"TTFT p50 {r['ttft_p50_s']:.3f}s p90 {r['ttft_p90_s']:.3f}s, failed {r['failed']}")
        print(f"TTFT p90 round robin / kv: {result['ttft_p90_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
