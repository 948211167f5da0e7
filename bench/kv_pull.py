"""A long prompt's prefix pulled from the engine that computed it, against computing it again: TTFT on a
second engine, both ways, side by side in one invocation.

`python -m bench.kv_pull [--prompts 4 --prompt-len 2000] [--json]`. Two engines in one process, each with
its KV transfer actor (the pull goes through their messages, not over TCP: the sealed transport's cost is
not in it). The holder computes each prompt; the other engine then serves it twice, with a pull and, as a
fresh request on a fresh prefix (the same prompt under another `cache_salt`), computing it. Greedy: the
tokens must agree.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from actors.config import EngineConfig
from actors.engine import start_engine
from actors.nodes.engine_node import attach_kv_transfer
from actors.messages.front_end import GetStats, SamplingParams, SubmitRequest
from bench.kv_tier import Timings, percentile
from runtime import ActorSystem


async def run(args) -> dict:
    system = ActorSystem("bench-kv-pull")
    await system.start()
    cfg = dict(model=args.model, num_threads=args.threads, kv_offload_memory=1 << 30)
    holder = await start_engine(EngineConfig(**cfg), system, name="holder")
    puller = await start_engine(EngineConfig(**cfg), system, name="puller")
    holder_tx = await attach_kv_transfer(system, holder, name="holder")
    await attach_kv_transfer(system, puller, name="puller")
    timings = Timings()
    ref = await system.spawn(timings, name="timings")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def serve(engine, rid, prompt, **kw):
        timings.sent[rid], timings.done[rid] = time.perf_counter(), asyncio.Event()
        engine.scheduler.tell(SubmitRequest(rid, prompt, params, ref, **kw))
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
    stats = await puller.scheduler.ask(GetStats())
    await holder.stop()
    await puller.stop()
    await system.shutdown()
    t = stats.kv_tier
    return {"prompts": args.prompts, "prompt_len": args.prompt_len, "same_tokens": same,
            "ttft_computed_p50_s": round(percentile(computed, 0.5), 3),
            "ttft_pulled_p50_s": round(percentile(pulled, 0.5), 3),
            "ttft_ratio_p50": round(percentile(computed, 0.5) / percentile(pulled, 0.5), 2),
            "ttft_ratio_p90": round(percentile(computed, 0.9) / percentile(pulled, 0.9), 2),
            "pulled_bytes": t.tier_bytes_pulled, "pull_s": round(t.tier_pull_s, 3),
            "pull_bytes_per_reused_token": round(t.tier_bytes_pulled / max(stats.prefix_cache_tier_hit_tokens, 1), 1)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = asyncio.run(run(args))
    print(json.dumps(out, indent=None if args.json else 2))
    return out


if __name__ == "__main__":
    main()
