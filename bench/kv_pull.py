"""A long prompt's prefix pulled from the engine that computed it, against computing it again: TTFT on a
second engine, both ways, side by side in one invocation.

`python -m bench.kv_pull [--prompts 4 --prompt-len 2000] [--processes] [--json]`. Two engines, each with
its KV transfer actor: in one process (the pull goes through their messages, not over TCP: the sealed
transport's cost is not in it), or with `--processes` as two `matinee serve --role engine` processes
registered in a Redis of the run's own, the pull going over the cluster's sealed TCP transport as between
machines. The holder computes each prompt; the other engine then serves it twice, with a pull and, as a
fresh request on a fresh prefix (the same prompt under another `cache_salt`), computing it. Greedy: the
tokens must agree.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time

from redis.exceptions import RedisError

from actors.config import EngineConfig
from actors.engine import start_engine
from actors.nodes.engine_node import attach_kv_transfer
from actors.messages.front_end import GetEngineInfo, GetStats, SamplingParams, SubmitRequest
from bench.cluster import Processes, _free_port
from bench.kv_tier import Timings, percentile
from runtime import ActorRef, ActorSystem
from runtime.redis_registry import RedisRegistry

SECRET = "bench-kv-pull-secret"


async def run(args) -> dict:
    system = ActorSystem("bench-kv-pull")
    await system.start()
    cfg = dict(model=args.model, num_threads=args.threads, kv_offload_memory=1 << 30, dtype=args.dtype)
    holder = await start_engine(EngineConfig(**cfg), system, name="holder")
    puller = await start_engine(EngineConfig(**cfg), system, name="puller")
    holder_tx = await attach_kv_transfer(system, holder, name="holder")
    await attach_kv_transfer(system, puller, name="puller")
    try:
        return await measure(args, system, holder.scheduler, puller.scheduler, holder_tx)
    finally:
        await holder.stop()
        await puller.stop()
        await system.shutdown()


async def run_processes(args) -> dict:
    """The same between two engine processes, the pull over the cluster's sealed transport."""
    procs = Processes(tempfile.mkdtemp(prefix="bench-kv-pull-"))
    serve = [sys.executable, "-m", "gateway.cli", "serve", "--role", "engine", "--kv-offload-memory", "1GiB",
             "--dtype", args.dtype,
             *(["--model", args.model] if args.model else []),
             *(["--num-threads", str(args.threads)] if args.threads else [])]
    system = ActorSystem("bench-kv-pull", secret=SECRET)
    registry = None
    try:
        redis_url = procs.start_redis()
        for i in range(2):
            procs.start(f"engine-{i}", [*serve, "--redis-url", redis_url, "--listen-port", str(_free_port()),
                                        "--engine-id", f"engine-{i}"], {"MATINEE_CLUSTER_SECRET": SECRET})
        await system.start()
        registry = RedisRegistry(redis_url, secret=SECRET)
        deadline = time.monotonic() + args.startup_timeout
        while len(entries := await _engines(registry)) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the two engines did not register in {args.startup_timeout} s ({procs.logdir})")
            await asyncio.sleep(0.5)
        fronts = [system.ref_for(node, path) for node, path in entries]
        infos = [await f.ask(GetEngineInfo(), timeout=30) for f in fronts]
        (holder, holder_info), (puller, _) = sorted(zip(fronts, infos), key=lambda fi: fi[1].engine_id)
        return await measure(args, system, holder, puller, holder_info.kv_receiver)
    finally:
        if registry is not None:
            await registry.close()
        await system.shutdown()
        procs.stop()


async def _engines(registry: RedisRegistry) -> list[tuple[str, str]]:
    try:
        return list((await registry.entries("engines/")).values())
    except (RedisError, OSError):   # Redis not up yet
        return []


async def measure(args, system: ActorSystem, holder: ActorRef, puller: ActorRef, holder_tx: ActorRef) -> dict:
    """Each prompt computed by the holder, then by the puller twice: pulled, and computed afresh."""
    timings = Timings()
    ref = await system.spawn(timings, name="timings")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def serve(engine, rid, prompt, **kw):
        timings.sent[rid], timings.done[rid] = time.perf_counter(), asyncio.Event()
        engine.tell(SubmitRequest(rid, prompt, params, ref, **kw))
        await timings.done[rid].wait()
        return timings.tokens[rid]

    rng = random.Random(args.seed)
    pulled, computed, same = [], [], True
    for i in range(args.prompts):
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
        expected = await serve(holder, f"h{i}", prompt)
        same &= await serve(puller, f"c{i}", prompt, cache_salt=f"fresh{i}") == expected
        computed.append(timings.ttft[f"c{i}"])
        same &= await serve(puller, f"p{i}", prompt, pull_from=holder_tx) == expected
        pulled.append(timings.ttft[f"p{i}"])
    stats = await puller.ask(GetStats())
    t = stats.kv_tier
    return {"engines": "two processes" if args.processes else "one process", "prompts": args.prompts, "prompt_len": args.prompt_len, "same_tokens": same,
            "ttft_computed_p50_s": round(percentile(computed, 0.5), 3),
            "ttft_pulled_p50_s": round(percentile(pulled, 0.5), 3),
            "ttft_ratio_p50": round(percentile(computed, 0.5) / percentile(pulled, 0.5), 2),
            "ttft_ratio_p90": round(percentile(computed, 0.9) / percentile(pulled, 0.9), 2),
            "pulls": t.tier_pulls, "pull_failures": t.tier_pull_failures, "pulls_skipped": stats.prefix_pulls_skipped,
            "pulled_bytes": t.tier_bytes_pulled, "pull_s": round(t.tier_pull_s, 3),
            "pull_bytes_per_reused_token": round(t.tier_bytes_pulled / max(stats.prefix_cache_tier_hit_tokens, 1), 1)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="both engines' (auto is measured at start)")
    p.add_argument("--processes", action="store_true", help="two engine processes, the pull over TCP")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = asyncio.run(run_processes(args) if args.processes else run(args))
    print(json.dumps(out, indent=None if args.json else 2))
    return out


if __name__ == "__main__":
    main()
