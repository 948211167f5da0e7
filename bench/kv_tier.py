"""Multi-turn chat on one engine whose KV pool holds a fraction of the working set: TTFT and prefill
tokens computed with the KV tier (host memory) against without, side by side in one invocation.

`python -m bench.kv_tier [--conversations 16 --turns 4 --system 256 ...] [--tier-dir EMPTY_DIR] [--json]`. Every conversation
shares one system prompt and re-sends its whole transcript each turn; turns go round the conversations
(a few at a time), so by a conversation's next turn the pool has evicted most of its blocks. Token ids
stand in for text (no tokenizer); greedy decoding, so both runs produce the same tokens (checked).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time

from actors.config import EngineConfig
from actors.engine import start_engine
from actors.messages.front_end import GetStats, SamplingParams, SubmitRequest, TokenDeltas
from runtime import Actor, ActorSystem


class Timings(Actor):
    """Records each request's first-token time and its tokens."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.done: dict[str, asyncio.Event] = {}

    async def receive(self, msg):
        assert isinstance(msg, TokenDeltas)
        now = time.perf_counter()
        for d in msg.deltas:
            if d.token_ids and d.request_id not in self.ttft:
                self.ttft[d.request_id] = now - self.sent[d.request_id]
            self.tokens.setdefault(d.request_id, []).extend(d.token_ids)
            self.cached[d.request_id] = d.num_cached_tokens
            if d.finish_reason is not None:
                self.done[d.request_id].set()


def percentile(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


async def run(args, tier: bool) -> dict:
    rng = random.Random(args.seed)
    system_prompt = [rng.randrange(100, 40000) for _ in range(args.system)]
    users = [[[rng.randrange(100, 40000) for _ in range(args.user)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    per_conv = args.system + args.turns * (args.user + args.output)
    working_set = (args.system + args.conversations * (per_conv - args.system)) // 16
    num_blocks = max(int(working_set * args.pool_fraction), per_conv // 16 + 2)
    cfg = EngineConfig(model=args.model, num_threads=args.threads, num_blocks=num_blocks, max_num_seqs=args.concurrency,
                       kv_offload_memory=args.tier_memory if tier else 0, batch_invariant=args.batch_invariant,
                       kv_offload_dir=args.tier_dir if tier else None)
    system = ActorSystem("bench-kv-tier")
    await system.start()
    engine = await start_engine(cfg, system)
    timings = Timings()
    ref = await system.spawn(timings, name="timings")
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    history = [list(system_prompt) for _ in range(args.conversations)]
    ttfts, cached, outputs = [], 0, []
    before = await engine.scheduler.ask(GetStats())
    started = time.perf_counter()
    for turn in range(args.turns):
        for wave in range(0, args.conversations, args.concurrency):
            ids = []
            for c in range(wave, min(wave + args.concurrency, args.conversations)):
                rid = f"c{c}t{turn}"
                history[c] += users[c][turn]
                timings.sent[rid], timings.done[rid] = time.perf_counter(), asyncio.Event()
                engine.scheduler.tell(SubmitRequest(rid, list(history[c]), params, ref))
                ids.append((c, rid))
            for c, rid in ids:
                await timings.done[rid].wait()
                history[c] += timings.tokens[rid]
                outputs.append(timings.tokens[rid])
                if turn > 0:   # a first turn has nothing to reuse but the system prompt, in both runs
                    ttfts.append(timings.ttft[rid])
                cached += timings.cached[rid]
    wall = time.perf_counter() - started
    after = await engine.scheduler.ask(GetStats())
    await engine.stop()
    await system.shutdown()
    tier_stats = after.kv_tier
    return {"tier": tier, "pool_blocks": num_blocks, "working_set_blocks": working_set, "wall_s": round(wall, 2),
            "ttft_p50_s": round(percentile(ttfts, 0.5), 4), "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
            "prefill_tokens": after.prefill_tokens - before.prefill_tokens, "cached_tokens": cached,
            "tier_hit_tokens": after.prefix_cache_tier_hit_tokens,
            "tier_loaded_bytes": tier_stats.tier_bytes_loaded if tier_stats else 0,
            "tier_load_s": round(tier_stats.tier_load_s, 3) if tier_stats else 0.0,
            "tier_hits_disk": tier_stats.tier_hits_disk if tier_stats else 0,
            "tier_hits_read_ahead": tier_stats.tier_hits_read_ahead if tier_stats else 0,
            "outputs": outputs}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=256, help="system prompt tokens, shared by every conversation")
    p.add_argument("--user", type=int, default=48, help="tokens of each user message")
    p.add_argument("--output", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--pool-fraction", type=float, default=0.25, help="the KV pool against the working set")
    p.add_argument("--tier-memory", type=int, default=1 << 30)
    p.add_argument("--tier-dir", default=None, help="a disk tier too (with --tier-memory 0, the disk alone)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-invariant", action="store_true",
                   help="both engines --batch-invariant: a reloaded block then holds the bits a recompute would, "
                        "so the outputs must match exactly (without it, bf16 KV computed in another batch may "
                        "turn a near-tie the other way, and the transcripts part from there)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    without = asyncio.run(run(args, tier=False))
    with_tier = asyncio.run(run(args, tier=True))
    outputs = list(zip(without.pop("outputs"), with_tier.pop("outputs")))
    same = next((i for i, (a, b) in enumerate(outputs) if a != b), len(outputs))
    out = {"machine": platform.processor() or platform.machine(), "args": vars(args), "without": without,
           "with_tier": with_tier, "same_tokens": same == len(outputs),
           "outputs_same_before_first_difference": same, "outputs": len(outputs),
           "ttft_p50_ratio": round(without["ttft_p50_s"] / with_tier["ttft_p50_s"], 2),
           "ttft_p90_ratio": round(without["ttft_p90_s"] / with_tier["ttft_p90_s"], 2),
           "prefill_ratio": round(without["prefill_tokens"] / max(with_tier["prefill_tokens"], 1), 2),
           "bytes_per_reused_token": round(with_tier["tier_loaded_bytes"] / max(with_tier["tier_hit_tokens"], 1), 1)}
    print(json.dumps(out, indent=None if args.json else 2), file=sys.stdout)
    return out


if __name__ == "__main__":
    main()
