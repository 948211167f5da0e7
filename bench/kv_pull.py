"""A long prompt's prefix pulled from the engine that computed it, against computing it again: TTFT on a
second engine, both ways, side by side in one invocation.

`python -m bench.kv_pull [--prompts 4 --prompt-len 2000] [--processes] [--json]`. Two engines, each with
its KV transfer actor: in one process (the pull goes through their messages, not over TCP: the sealed
transport's cost is not in it), or with `--processes` as two `matinee serve --role engine` processes
registered in a Redis of the run's own, the pull going over the cluster's sealed TCP transport as between
machines. The holder computes each prompt; the other engine then serves it twice, with a pull and, as a
fresh request on a fresh prefix (the same prompt under another `cache_salt`), computing it. Greedy: the
tokens must agree.

With `--gateway`, conversations whose turns a gateway routes to both engines: two engine processes and two
`matinee serve --role gateway` processes over them, both `--routing round_robin` (so a conversation's turns
land on the engines in turn), one pulling each turn's prefix from the engine that holds it, the other
(`--no-prefix-pull`) computing it. Both get the same conversations under a `cache_salt` each (no cache is
inherited), one turn at a time over HTTP; greedy, so the replies must agree. TTFT is of turns 2 and later,
whose prompts hold the earlier turns.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time

import aiohttp
from redis.exceptions import RedisError

from actors.config import EngineConfig
from actors.engine import start_engine
from actors.nodes.engine_node import attach_kv_transfer
from actors.messages.front_end import GetEngineInfo, GetStats, SamplingParams, SubmitRequest
from bench.cluster import Processes, StreamError, _free_port, gateways_up, sse_events
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


async def run_gateway(args) -> dict:
    """Conversations through two gateways over the same two engine processes: pulling, and not."""
    procs = Processes(tempfile.mkdtemp(prefix="bench-kv-pull-"))
    env = {"MATINEE_CLUSTER_SECRET": SECRET}
    serve = [sys.executable, "-m", "gateway.cli", "serve", *(["--model", args.model] if args.model else [])]
    system = ActorSystem("bench-kv-pull", secret=SECRET)
    registry = None
    try:
        redis_url = procs.start_redis()
        for i in range(2):
            procs.start(f"engine-{i}", [*serve, "--role", "engine", "--kv-offload-memory", "1GiB", "--dtype",
                                        args.dtype, "--num-threads", str(args.threads or 1), "--redis-url",
                                        redis_url, "--listen-port", str(_free_port()), "--engine-id",
                                        f"engine-{i}", *(["--batch-invariant"] if args.batch_invariant else [])],
                        env)
        gateways = {}
        for name, pull in (("pulled", []), ("computed", ["--no-prefix-pull"])):
            port = _free_port()
            procs.start(f"gateway-{name}", [*serve, "--role", "gateway", "--redis-url", redis_url, "--port",
                                            str(port), "--routing", "round_robin", *pull], env)
            gateways[name] = f"http://127.0.0.1:{port}"
        await system.start()
        registry = RedisRegistry(redis_url, secret=SECRET)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await gateways_up(session, gateways.values(), args.startup_timeout)
            fronts = [system.ref_for(node, path) for node, path in await _engines(registry)]
            phases = {}
            for name, base in gateways.items():
                print(f"bench.kv_pull: conversations, {name}...", file=sys.stderr, flush=True)
                before = [await f.ask(GetStats(), timeout=30) for f in fronts]
                phases[name] = await _conversations(session, base, args, f"bench-{name}")
                after = [await f.ask(GetStats(), timeout=30) for f in fronts]
                phases[name].update(_moved(before, after))
        return _compare(args, phases, procs.logdir)
    finally:
        if registry is not None:
            await registry.close()
        await system.shutdown()
        procs.stop()


async def _conversations(session: aiohttp.ClientSession, base: str, args, salt: str) -> dict:
    """`args.conversations` conversations of `args.turns` turns, one turn at a time: each prompt is
    the conversation so far (system prompt, then each turn's user tokens and reply) and a new user turn."""
    rng = random.Random(args.seed)
    ttfts, cached, prompt_lens, turns = [], [], [], []
    for _ in range(args.conversations):
        prompt = [rng.randrange(4, args.vocab) for _ in range(args.prompt_len)]
        for turn in range(args.turns):
            prompt += [rng.randrange(4, args.vocab) for _ in range(args.user)]
            out = await _turn(session, base, prompt, args.reply, salt)
            if turn > 0:
                ttfts.append(out["ttft"])
                cached.append(out["cached"])
                prompt_lens.append(len(prompt))
            turns.append(out["tokens"])
            prompt += out["tokens"]
    return {"ttft_p50_s": round(percentile(ttfts, 0.5), 3), "ttft_p90_s": round(percentile(ttfts, 0.9), 3),
            "cached_tokens": sum(cached), "prompt_tokens": sum(prompt_lens),
            "shortest_prompt": min(prompt_lens), "replies": turns}


async def _turn(session: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int, salt: str) -> dict:
    """One streamed completion of token ids: its TTFT, cached prompt tokens, and reply's token ids."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "cache_salt": salt,
            "logprobs": 0, "return_tokens_as_token_ids": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, cached, tokens = None, 0, []
    async with session.post(base + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for ev in sse_events(r):
            for choice in ev.get("choices") or ():
                ttft = ttft if ttft is not None else time.perf_counter() - start
                tokens += [int(t.removeprefix("token_id:")) for t in (choice.get("logprobs") or {}).get("tokens", ())]
            if ev.get("usage"):
                cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
    if ttft is None or len(tokens) != max_tokens:
        raise StreamError(f"a turn came back with {len(tokens)} of {max_tokens} tokens")
    return {"ttft": ttft, "cached": cached, "tokens": tokens}


def _moved(before: list, after: list) -> dict:
    """The engines' pulls during a phase, summed over both."""
    def diff(name: str, of=lambda s: s.kv_tier) -> int | float:
        return sum(getattr(of(a), name) - getattr(of(b), name) for b, a in zip(before, after))
    return {"pulls": diff("tier_pulls"), "pull_failures": diff("tier_pull_failures"),
            "pulls_skipped": diff("prefix_pulls_skipped", lambda s: s), "pulled_bytes": diff("tier_bytes_pulled"),
            "pull_s": round(diff("tier_pull_s"), 3),
            "tier_hit_tokens": diff("prefix_cache_tier_hit_tokens", lambda s: s)}


def _compare(args, phases: dict, logdir: str) -> dict:
    pulled, computed = phases["pulled"], phases["computed"]
    same = pulled.pop("replies") == computed.pop("replies")
    return {"engines": "two processes behind gateways, round robin", "conversations": args.conversations,
            "turns": args.turns, "prompt_len": args.prompt_len, "user": args.user, "reply": args.reply,
            "ttft_ratio_p50": round(computed["ttft_p50_s"] / pulled["ttft_p50_s"], 2),
            "ttft_ratio_p90": round(computed["ttft_p90_s"] / pulled["ttft_p90_s"], 2),
            "prefill_tokens_computed": {k: v["prompt_tokens"] - v["cached_tokens"] for k, v in phases.items()},
            "pull_bytes_per_reused_token": round(pulled["pulled_bytes"] / max(pulled["tier_hit_tokens"], 1), 1),
            "same_tokens": same, "pulled": pulled, "computed": computed, "logs": logdir}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="both engines' (auto is measured at start)")
    p.add_argument("--processes", action="store_true", help="two engine processes, the pull over TCP")
    p.add_argument("--gateway", action="store_true",
                   help="conversations through gateways over two engine processes, their turns routed in turn")
    p.add_argument("--conversations", type=int, default=4, help="--gateway: conversations, one after another")
    p.add_argument("--turns", type=int, default=4, help="--gateway: turns of each (its system prompt --prompt-len)")
    p.add_argument("--user", type=int, default=64, help="--gateway: tokens of each user turn")
    p.add_argument("--reply", type=int, default=16, help="--gateway: tokens of each reply")
    p.add_argument("--vocab", type=int, default=40000, help="--gateway: prompt token ids are drawn below this")
    p.add_argument("--batch-invariant", action="store_true",
                   help="--gateway: the engines' --batch-invariant (a pulled prefix then gives the same bits)")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = asyncio.run(run_gateway(args) if args.gateway else run_processes(args) if args.processes else run(args))
    print(json.dumps(out, indent=None if args.json else 2))
    return out


if __name__ == "__main__":
    main()
