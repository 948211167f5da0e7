"""The KV tier in the prefix index: an engine's tier blocks are indexed beside its pool's, tagged, so
`match_tiers` tells how much of a prompt each engine can serve without computing (in the memory store
and in Redis alike, from events or a snapshot), and the router prefers reloading to recomputing."""

from __future__ import annotations

import random

import pytest

from prefix_store import EngineLoad, PrefixRouter, RoutingPolicy, hash_full_blocks
from tests.actors.test_kv_tier import BS, Engine


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(blocks * BS + 1)]


async def test_the_index_follows_pool_and_tier_exactly(store, tmp_path):
    from actors.kv.tier_disk import DiskTier
    from tests.actors.test_kv_tier import IDENTITY

    e = Engine(num_blocks=8, memory_bytes=3 * 1024, disk=DiskTier(str(tmp_path), IDENTITY, 6 * 1100))
    await store.publish_snapshot("e", *reversed(e.kv.snapshot()))
    rng = random.Random(7)
    prompts = [prompt(s, rng.randrange(1, 5)) for s in range(6)]
    for step in range(40):
        e.run(f"r{step}", prompts[rng.randrange(len(prompts))])
        if step % 5 == 4:
            e.tier.disk.flush()
        await store.apply_events("e", e.kv.take_events())
        for p in prompts:
            hashes = hash_full_blocks(p, BS)
            pool, reach = (await store.match_tiers(hashes))["e"]
            assert pool == sum(1 for _ in _leading(hashes, lambda h: e.kv._pool.lookup(h) is not None))
            assert reach == sum(1 for _ in _leading(hashes, lambda h: e.kv._pool.lookup(h) is not None or h in e.tier))
    next_seq, keys = e.kv.snapshot()
    fresh = await _twin(store, keys, next_seq)
    for p in prompts:
        hashes = hash_full_blocks(p, BS)
        assert await fresh.match_tiers(hashes) == {"e2": (await store.match_tiers(hashes))["e"]}
    e.tier.close()


def _leading(hashes, present):
    for h in hashes:
        if not present(h):
            return
        yield h


async def _twin(store, keys, next_seq):
    await store.publish_snapshot("e2", keys, next_seq)

    class Only:
        async def match_tiers(self, hashes):
            return {k: v for k, v in (await store.match_tiers(hashes)).items() if k == "e2"}
    return Only()


async def test_the_router_prefers_an_engine_that_reloads_to_one_that_recomputes(store):
    hashes = hash_full_blocks(prompt(1, 8), BS)
    from prefix_store import BlockStored
    await store.publish_snapshot("pool", hashes[:2], 0)            # two blocks in its pool
    await store.publish_snapshot("tier", hashes[:1], 0)
    await store.apply_events("tier", [BlockStored(0, hashes[1:8], None, [], 0, tier=True)])
    assert (await store.match_tiers(hashes)) == {"pool": (2, 2), "tier": (1, 8)}
    router = PrefixRouter(store, RoutingPolicy(), timeout_s=5)
    idle = [EngineLoad("pool", 0, 0, 100, 100), EngineLoad("tier", 0, 0, 100, 100)]
    decision = await router.route(hashes, lambda: idle)
    assert (decision.engine_id, decision.matched_blocks, decision.tier_blocks) == ("tier", 1, 7)
    assert (await store.match(hashes)) == {"pool": 2, "tier": 1}   # the pool-only answer is unchanged
    # A tier block costs a fraction of a computed one: with equal reach, the pool wins.
    await store.apply_events("pool", [BlockStored(0, hashes[2:8], hashes[1], [], BS)])
    assert (await router.route(hashes, lambda: idle)).engine_id == "pool"


@pytest.mark.parametrize("counts, winner", [({"a": (0, 6), "b": (5, 5)}, "a"), ({"a": (0, 4), "b": (4, 4)}, "b")])
def test_the_policy_counts_a_reloaded_block_as_a_fraction_of_a_computed_one(counts, winner):
    loads = [EngineLoad("a"), EngineLoad("b")]
    assert RoutingPolicy().choose(loads, counts, 8).engine_id == winner


def test_an_engine_holding_enough_more_of_the_prompt_is_named_to_pull_from():
    policy = RoutingPolicy()
    busy, idle = EngineLoad("busy", requests_waiting=10), EngineLoad("idle")
    decision = policy.choose([busy, idle], {"busy": (3, 8), "idle": (0, 2)}, 8)
    assert (decision.engine_id, decision.pull_from) == ("idle", "busy")    # the load outweighs the prefix
    assert policy.choose([busy, idle], {"busy": (3, 5), "idle": (0, 2)}, 8).pull_from is None   # 3 < 4 more
    assert policy.choose([busy, idle], {"busy": 8, "idle": 0}, 8).pull_from == "busy"



def test_the_pull_source_of_an_engine_chosen_without_the_index():
    policy = RoutingPolicy()
    loads = [EngineLoad("a"), EngineLoad("b"), EngineLoad("c")]
    assert policy.pull_source(loads, {"a": (2, 8), "b": 5, "c": 0}, 8, "c") == "a"   # the most, tier included
    assert policy.pull_source(loads, {"a": 8, "b": 0}, 8, "a") is None                 # it holds them itself
    assert policy.pull_source(loads, {"a": 4, "b": 1}, 8, "b") is None                 # 3 more: not enough
    assert policy.pull_source(loads, None, 8, "b") is None                             # the index did not answer
