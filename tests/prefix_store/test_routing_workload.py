"""End to end without the network: tenants' prompts routed over real KV managers, the index
fed by their events. KV-aware routing keeps each tenant's system prompt cached on one engine;
round robin makes both engines hold every tenant, and their caches thrash."""

from __future__ import annotations

import random
from collections import deque

import pytest

from actors.kv.manager import KVCacheManager
from actors.kv.structs import KVCacheConfig, KVRequest
from tests.prefix_store.kv_workload import ManagerEvents
from prefix_store import (EngineLoad, IndexPublisher, InMemoryPrefixStore, PrefixRouter, PromptHasher,
                          TenantSalts)

BLOCK = 16
SYSTEM_TOKENS = 256  # 16 blocks per tenant
TENANTS = 8
# Room for about five tenants' system prompts beside the running requests: one engine cannot
# keep all eight, two engines splitting them can.
NUM_BLOCKS = 100
MAX_RUNNING = 4


class SimEngine:
    def __init__(self, engine_id: str, store):
        self.engine_id = engine_id
        self.kv = KVCacheManager(KVCacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK))
        self.publisher = IndexPublisher(store, engine_id, ManagerEvents(self.kv))
        self.running: deque[str] = deque()

    def load(self) -> EngineLoad:
        kv = self.kv
        return EngineLoad(self.engine_id, len(self.running), 0, kv.num_total_blocks, kv.num_free_blocks)

    def serve(self, request: KVRequest) -> int:
        """Admit (retiring the oldest requests for room) and prefill; returns cached tokens."""
        while len(self.running) >= MAX_RUNNING:
            self.kv.free(self.running.popleft())
        hit = self.kv.get_computed_blocks(request)
        new = len(request.token_ids) - hit.num_computed_tokens
        while not self.kv.can_allocate(request.seq_id, new, hit=hit):
            self.kv.free(self.running.popleft())
            hit = self.kv.get_computed_blocks(request)
            new = len(request.token_ids) - hit.num_computed_tokens
        self.kv.allocate_slots(request.seq_id, new, hit=hit)
        self.running.append(request.seq_id)
        return hit.num_computed_tokens


async def run_workload(kv_aware: bool, num_requests: int = 300, seed: int = 0) -> tuple[float, float]:
    """(system prompt tokens found cached, share of requests the busier engine got)."""
    rng = random.Random(seed)
    store = InMemoryPrefixStore()
    engines = [SimEngine(f"e{i}", store) for i in range(2)]
    for engine in engines:
        await engine.publisher.start()
    router = PrefixRouter(store)
    hasher = PromptHasher(BLOCK, TenantSalts("server-secret"))
    system = {f"key-{t}": [rng.randrange(32000) for _ in range(SYSTEM_TOKENS)] for t in range(TENANTS)}
    hit_tokens, served = 0, {e.engine_id: 0 for e in engines}
    for i in range(num_requests):
        api_key = rng.choice(sorted(system))
        prompt = system[api_key] + [rng.randrange(32000) for _ in range(rng.randrange(8, 40))]
        salt = hasher.cache_salt(api_key)
        if kv_aware:
            decision = await router.route(hasher.block_hashes(prompt, salt), lambda: [e.load() for e in engines])
            engine = next(e for e in engines if e.engine_id == decision.engine_id)
        else:
            engine = engines[i % len(engines)]
        served[engine.engine_id] += 1
        hit_tokens += min(engine.serve(KVRequest(f"r{i}", prompt, salt)), SYSTEM_TOKENS)
        await engine.publisher.publish()
    return hit_tokens / (num_requests * SYSTEM_TOKENS), max(served.values()) / num_requests


@pytest.mark.parametrize("seed", [0, 1])
async def test_kv_aware_routing_keeps_tenants_prompts_cached(seed):
    routed, busiest = await run_workload(kv_aware=True, seed=seed)
    round_robin, _ = await run_workload(kv_aware=False, seed=seed)
    # Misses left to KV-aware routing: each tenant's first request, and little else.
    assert routed >= 0.9
    assert round_robin <= 0.75
    assert routed - round_robin >= 0.2
    assert busiest <= 0.7  # tenants are split between the engines, not piled on one
