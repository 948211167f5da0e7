"""Pulling a prompt's prefix from the engine that holds it: the blocks go into the puller's KV tier over
the transfer actors, and the puller's greedy tokens equal the holder's without prefilling them; a
peer that is gone, another tenant's salt or another KV layout only cost the prefill. A LoRA adapter's
prefix is pulled under the adapter's hashes, never the base model's."""
from __future__ import annotations

import pytest

from actors.config import EngineConfig
from actors.engine import start_engine
from actors.nodes.engine_node import attach_kv_transfer
from actors.messages.front_end import GetStats, SubmitRequest
from runtime import ActorSystem
from tests.actors.test_kv_handoff import GREEDY, Front


def _config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", num_threads=1, block_size=16, num_blocks=48,
                        max_num_batched_tokens=128, kv_offload_memory=16 << 20, **kw)


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    from tests.actors.lora_adapters import make_adapter
    return make_adapter(tiny_model_dir("llama"), str(tmp_path_factory.mktemp("pull-lora")), "attn")


@pytest.fixture
async def pair(tiny_model_dir, request):
    model = tiny_model_dir("llama")
    # With the indirect parameter "lora": both engines serve one adapter, "a".
    lora = getattr(request, "param", None) == "lora"
    kw = {"lora_modules": [f"a={request.getfixturevalue('adapter')}"]} if lora else {}
    system = ActorSystem("pull-test")
    await system.start()
    holder = await start_engine(_config(model, **kw), system, name="holder")
    puller = await start_engine(_config(model, **kw), system, name="puller")
    holder_tx = await attach_kv_transfer(system, holder, name="holder")
    puller_tx = await attach_kv_transfer(system, puller, name="puller")
    front = Front()
    ref = await system.spawn(front, name="front")
    yield system, holder, puller, holder_tx, puller_tx, front, ref
    for tx in (holder_tx, puller_tx):
        if tx.is_alive:
            await system.stop(tx)
    await holder.stop()
    await puller.stop()
    await system.shutdown()


PROMPT = [(i * 37) % 300 + 4 for i in range(150)]


async def run(engine, front, ref, rid, prompt, pull_from=None, salt=None, lora=None):
    # An adapter's key (name@contents) as the router hands it on: from the engine's stats.
    key = None if lora is None else (await engine.scheduler.ask(GetStats())).lora_keys[lora]
    engine.scheduler.tell(SubmitRequest(rid, prompt, GREEDY, ref, cache_salt=salt, pull_from=pull_from,
                                        lora_name=lora, lora_key=key))
    await front.wait(lambda: rid in front.finished)
    return front.tokens[rid]


async def test_a_pulled_prefix_decodes_the_holders_tokens_without_a_prefill(pair):
    system, holder, puller, holder_tx, _, front, ref = pair
    expected = await run(holder, front, ref, "h", PROMPT)
    before = await puller.scheduler.ask(GetStats())
    assert await run(puller, front, ref, "p", PROMPT, pull_from=holder_tx) == expected
    after = await puller.scheduler.ask(GetStats())
    full = (len(PROMPT) - 1) // 16 * 16
    assert after.prefix_cache_tier_hit_tokens - before.prefix_cache_tier_hit_tokens == full
    assert after.prefill_tokens - before.prefill_tokens == len(PROMPT) - full
    assert after.kv_tier.tier_bytes_pulled == full // 16 * puller.kv_blocks.bytes_per_block
    assert (after.kv_tier.tier_pulls, after.kv_tier.tier_pull_failures) == (1, 0) and after.kv_tier.tier_pull_s > 0


async def test_another_tenant_pulls_nothing(pair):
    system, holder, puller, holder_tx, _, front, ref = pair
    expected = await run(holder, front, ref, "h", PROMPT, salt="tenant-a")
    assert await run(puller, front, ref, "p", PROMPT, pull_from=holder_tx, salt="tenant-b") == expected
    stats = await puller.scheduler.ask(GetStats())
    assert stats.prefix_cache_tier_hit_tokens == 0 and stats.kv_tier.tier_bytes_pulled == 0


async def test_a_peer_that_is_gone_costs_only_the_prefill(pair):
    system, holder, puller, holder_tx, _, front, ref = pair
    expected = await run(holder, front, ref, "h", PROMPT)
    await system.stop(holder_tx)
    assert await run(puller, front, ref, "p", PROMPT, pull_from=holder_tx) == expected
    stats = await puller.scheduler.ask(GetStats())
    assert stats.prefix_cache_tier_hit_tokens == 0 and stats.prefill_tokens == len(PROMPT)
    assert (stats.kv_tier.tier_pulls, stats.kv_tier.tier_pull_failures) == (1, 1)
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_a_request_aborted_while_its_prefix_is_pulled_never_runs(pair):
    from actors.messages.front_end import AbortRequest

    system, holder, puller, holder_tx, _, front, ref = pair
    expected = await run(holder, front, ref, "h", PROMPT)
    puller.scheduler.tell(SubmitRequest("gone", PROMPT, GREEDY, ref, pull_from=holder_tx))
    puller.scheduler.tell(AbortRequest("gone"))
    assert await run(puller, front, ref, "next", PROMPT) == expected   # after the pull: from the tier
    stats = await puller.scheduler.ask(GetStats())
    assert "gone" not in front.tokens and stats.prompt_tokens == len(PROMPT)
    assert stats.kv_blocks_free == stats.kv_blocks_total



@pytest.mark.parametrize("pair", ["lora"], indirect=True)
async def test_an_adapters_prefix_is_pulled_under_the_adapters_hashes(pair):
    system, holder, puller, holder_tx, _, front, ref = pair
    base = await run(holder, front, ref, "h-base", PROMPT)
    expected = await run(holder, front, ref, "h", PROMPT, lora="a")
    assert expected != base   # the adapter changes the tokens, so base blocks would be wrong ones
    assert await run(puller, front, ref, "p", PROMPT, pull_from=holder_tx, lora="a") == expected
    stats = await puller.scheduler.ask(GetStats())
    full = (len(PROMPT) - 1) // 16 * 16
    assert stats.prefix_cache_tier_hit_tokens == full and stats.prefill_tokens == len(PROMPT) - full
    # The base model's request finds none of the adapter's blocks, pulled or not.
    assert await run(puller, front, ref, "p-base", PROMPT, pull_from=holder_tx) == base
    after = await puller.scheduler.ask(GetStats())
    assert after.prefix_cache_tier_hit_tokens - stats.prefix_cache_tier_hit_tokens == full   # the holder's base blocks
    assert after.kv_tier.tier_bytes_pulled == 2 * full // 16 * puller.kv_blocks.bytes_per_block


async def test_a_link_measured_slow_makes_the_engine_compute_instead_of_pulling(tiny_model_dir, tmp_path):
    """The holder gives its first pull from a disk tier whose first block file is a pipe written two
    seconds late: the puller measures a link far slower than its own prefill, and computes the next
    prompt a peer could give instead of pulling it (the blocks the holder has in its pool, fast or not)."""
    import asyncio
    import os
    import threading

    from prefix_store import hash_full_blocks

    model = tiny_model_dir("llama")
    system = ActorSystem("slow-pull-test")
    await system.start()
    holder = await start_engine(EngineConfig(model=model, dtype="float32", num_threads=1, block_size=16, num_blocks=12,
                                             max_num_batched_tokens=128, kv_offload_dir=str(tmp_path / "tier")),
                                system, name="holder")
    puller = await start_engine(_config(model), system, name="puller")
    holder_tx = await attach_kv_transfer(system, holder, name="holder")
    await attach_kv_transfer(system, puller, name="puller")
    front = Front()
    ref = await system.spawn(front, name="front")
    try:
        others = [[(i * k) % 300 + 4 for i in range(150)] for k in (41, 43, 47)]
        expected = await run(holder, front, ref, "h", PROMPT)
        expected_other = [await run(holder, front, ref, f"h{i}", p) for i, p in enumerate(others[:2])]
        path = os.path.join(holder.kv_tier.disk.blocks_dir, hash_full_blocks(PROMPT, 16)[0].hex() + ".kvb")
        while not os.path.exists(path):       # PROMPT's blocks left the holder's pool for its disk
            await asyncio.sleep(0.02)
        holder.kv_tier.disk.flush()
        raw = open(path, "rb").read()
        os.unlink(path)
        os.mkfifo(path)

        def write_late() -> None:
            with open(path, "wb") as pipe:    # returns once the holder opened it to read
                threading.Event().wait(2.0)
                pipe.write(raw)

        threading.Thread(target=write_late, daemon=True).start()
        await run(puller, front, ref, "warm", others[2])   # the puller's own prefill rate, measured
        assert await run(puller, front, ref, "p", PROMPT, pull_from=holder_tx) == expected
        stats = await puller.scheduler.ask(GetStats())
        assert (stats.kv_tier.tier_pulls, stats.kv_tier.tier_pull_failures) == (1, 0)
        assert stats.prefix_cache_tier_hit_tokens == (len(PROMPT) - 1) // 16 * 16
        cost = puller.scheduler_actor.pulls.cost
        assert cost.block_ratio(holder_tx.node) > 1.0   # pulling a block from it took longer than computing one

        before = stats
        assert await run(puller, front, ref, "p2", others[1], pull_from=holder_tx) == expected_other[1]
        after = await puller.scheduler.ask(GetStats())
        assert after.kv_tier.tier_pulls == 1 and after.prefix_pulls_skipped == 1
        assert 0 < after.pull_bytes_per_s * 16 < after.prefill_tokens_per_s * puller.kv_blocks.bytes_per_block
        assert after.prefill_tokens - before.prefill_tokens == len(others[1])
        assert after.kv_blocks_free == after.kv_blocks_total
    finally:
        await holder.stop()
        await puller.stop()
        await system.shutdown()
