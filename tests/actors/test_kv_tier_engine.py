"""The KV tier in a running engine: a prompt whose blocks the pool evicted is copied back instead of
prefilled (cached_tokens counts it), and its greedy tokens are still transformers' own (with an int8
cache, the ones it computed); two tenants never share a block through the tier."""
from __future__ import annotations

import pytest

from actors.config import EngineConfig
from actors.engine import start_engine
from actors.messages.front_end import GetStats, SamplingParams, SubmitRequest
from runtime import ActorSystem
from tests.actors.test_engine import Sink
from tests.actors.test_llm_parity import GREEDY, hf_greedy, prompts

LENS = (150, 120, 130)   # each alone fills most of a pool of 12 blocks of 16


@pytest.fixture(params=["auto", "int8"])
async def engine(request, tiny_model_dir, tmp_path):
    system = ActorSystem("tier-test")
    await system.start()
    cfg = EngineConfig(model=tiny_model_dir("qwen2"), dtype="float32", num_threads=1, block_size=16,
                       num_blocks=12, max_num_batched_tokens=64, max_num_seqs=1, kv_offload_memory=32 << 20,
                       kv_offload_dir=str(tmp_path / "tier"), kv_cache_dtype=request.param)
    eng = await start_engine(cfg, system)
    sink = Sink()
    ref = await system.spawn(sink, name="sink")
    yield eng, sink, ref
    await eng.stop()
    await system.shutdown()


async def run(eng, sink, ref, rid, prompt, salt=None):
    eng.scheduler.tell(SubmitRequest(rid, prompt, GREEDY, ref, cache_salt=salt))
    await sink.wait(lambda: (rid, 0) in sink.finish)
    return sink.tokens[(rid, 0)], sink.cached[(rid, 0)]


async def test_an_evicted_prompt_is_copied_back_and_decodes_transformers_tokens(engine, tiny_model_dir):
    eng, sink, ref = engine
    batch = prompts(3, LENS)
    expected = hf_greedy(tiny_model_dir("qwen2"), batch)
    computed = [await run(eng, sink, ref, f"first{i}", p) for i, p in enumerate(batch)]   # each evicts the one before
    assert [cached for _, cached in computed] == [0, 0, 0]
    if eng.config.kv_cache_dtype == "auto":
        assert [tokens for tokens, _ in computed] == expected
    expected = [tokens for tokens, _ in computed]   # an int8 cache's own (its scales travel with the blocks)
    before = await eng.scheduler.ask(GetStats())
    tokens, cached = await run(eng, sink, ref, "again", batch[0])
    assert tokens == expected[0]
    assert cached == (LENS[0] - 1) // 16 * 16            # every full block of the prompt, from the tier
    stats = await eng.scheduler.ask(GetStats())
    assert stats.prefix_cache_tier_hit_tokens - before.prefix_cache_tier_hit_tokens == cached
    assert stats.prefill_tokens - before.prefill_tokens <= LENS[0] - cached
    tier = stats.kv_tier
    assert tier.tier_hits_memory == cached // 16 and tier.tier_bytes_loaded > 0 and tier.tier_blocks > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_two_tenants_never_share_a_block_through_the_tier(engine, tiny_model_dir):
    eng, sink, ref = engine
    batch = prompts(4, LENS)
    expected, cached = await run(eng, sink, ref, "a", batch[0], salt="tenant-a")
    assert cached == 0
    await run(eng, sink, ref, "evict1", batch[1])
    await run(eng, sink, ref, "evict2", batch[2])
    assert await run(eng, sink, ref, "b", batch[0], salt="tenant-b") == (expected, 0)
    await run(eng, sink, ref, "evict3", batch[1])
    tokens, cached = await run(eng, sink, ref, "a2", batch[0], salt="tenant-a")
    assert tokens == expected and cached > 0


async def test_a_waiting_prompts_disk_blocks_are_read_before_its_step(tiny_model_dir, tmp_path):
    """With the tier on disk alone, a prompt that waits behind another request has its blocks read while it
    waits (the scheduler tells the KV manager as it arrives): its step copies them back without a read, and
    the tokens are those it computed."""
    system = ActorSystem("tier-read-ahead-test")
    await system.start()
    cfg = EngineConfig(model=tiny_model_dir("qwen2"), dtype="float32", num_threads=1, block_size=16,
                       num_blocks=12, max_num_batched_tokens=64, max_num_seqs=1, kv_offload_memory=0,
                       kv_offload_dir=str(tmp_path / "tier"))
    eng = await start_engine(cfg, system)
    try:
        sink = Sink()
        ref = await system.spawn(sink, name="sink")
        batch = prompts(5, LENS)
        expected, _ = await run(eng, sink, ref, "first", batch[0])
        for i in (1, 2):
            await run(eng, sink, ref, f"evict{i}", batch[i])   # the first prompt's blocks: on disk alone
        before = await eng.scheduler.ask(GetStats())
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        eng.scheduler.tell(SubmitRequest("ahead", batch[1][:40], long, ref))   # the one slot, for a while
        tokens, cached = await run(eng, sink, ref, "again", batch[0])
        assert tokens == expected and cached == (LENS[0] - 1) // 16 * 16
        tier = (await eng.scheduler.ask(GetStats())).kv_tier
        assert tier.tier_hits_disk - before.kv_tier.tier_hits_disk == cached // 16
        assert tier.tier_hits_read_ahead - before.kv_tier.tier_hits_read_ahead == cached // 16
    finally:
        await eng.stop()
        await system.shutdown()
