"""Two engines with a KV tier behind a gateway, over a redis-server of their own: once an engine's pool
has evicted a prompt into its tier, the index (real Redis) shows the prompt reloadable there, the
gateway sends the prompt back to that engine and it reloads instead of prefilling."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from prefix_store import RedisPrefixStore, hash_full_blocks
from tests.cluster import harness as h
from tests.cluster.test_cluster import Cluster, model  # noqa: F401  (the module's tiny model)

pytestmark = pytest.mark.slow

BLOCK = 16


class TierCluster(Cluster):
    def start_engine(self, port: int) -> h.Node:
        args = h.engine_args(self.model, self.redis.url, port) + ["--num-blocks", "24",
                                                                  "--kv-offload-memory", "64MiB"]
        node = h.Node(args, str(self.logs / f"engine-{port}.log"))
        self.engines[port] = node.start()
        return node


def match_tiers(redis_url: str, tokens: list[int]) -> dict[str, tuple[int, int]]:
    async def ask():
        store = RedisPrefixStore.from_url(redis_url)
        try:
            return await store.match_tiers(hash_full_blocks(tokens, BLOCK))
        finally:
            await store.close()
    return asyncio.run(ask())


def test_a_prompt_evicted_into_an_engines_tier_goes_back_there_and_reloads(model, tmp_path):  # noqa: F811
    cluster = TierCluster(model, tmp_path)
    try:
        cluster.start()
        rng = random.Random(3)
        prompts = [[rng.randrange(4, 360) for _ in range(160)] for _ in range(4)]
        first = [cluster.complete(p, max_tokens=4) for p in prompts]
        for _ in range(8):   # new prompts, spread by load, each fills most of a pool of 24 blocks
            cluster.complete([rng.randrange(4, 360) for _ in range(300)], max_tokens=2)
        time.sleep(0.5)      # engines publish their events within tens of milliseconds
        full = (160 - 1) // BLOCK
        for p, before in zip(prompts, first):
            counts = match_tiers(cluster.redis.url, p)
            holder = max(counts, key=lambda e: counts[e][1])
            pool, reach = counts[holder]
            assert reach >= full and pool < full, counts   # reloadable, not mapped
            body = cluster.complete(p, max_tokens=4)
            assert body["choices"][0]["text"] == before["choices"][0]["text"]
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= full * BLOCK
    finally:
        cluster.stop()
