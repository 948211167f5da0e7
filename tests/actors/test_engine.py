"""The engine's actors driven through their messages, as the gateway drives them.

A small sink actor stands in for the gateway: it submits, receives TokenDeltas and aborts.
Covers requests joining a running batch (with transformers parity), abort freeing blocks at once,
streaming while the forward runs, an idle scheduler that does not spin, and the stats.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from actors.config import EngineConfig
from actors.engine import start_engine
from actors.worker.model_runner import ModelRunner
from actors.messages.front_end import AbortRequest, GetStats, SamplingParams, SubmitRequest, TokenDeltas
from actors.messages.kv import DrainKVEvents, GetKVSnapshot, GetKVStats, KVEventsWaiting, SubscribeKVEvents
from prefix_store import BlockStored
from runtime import Actor, ActorSystem
from tests.actors.test_llm_parity import GREEDY, NUM_NEW, hf_greedy, prompts
from tests.actors.waiting import wait_until


class Sink(Actor):
    def __init__(self):
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.finish: dict[tuple[str, int], str] = {}
        self.errors: dict[tuple[str, int], str | None] = {}
        self.cached: dict[tuple[str, int], int] = {}
        self.messages = 0
        self.changed = asyncio.Event()

    async def receive(self, msg):
        assert isinstance(msg, TokenDeltas)
        self.messages += 1
        for d in msg.deltas:
            key = (d.request_id, d.index)
            assert key not in self.finish, "a delta after the finish"
            self.tokens.setdefault(key, []).extend(d.token_ids)
            self.cached[key] = d.num_cached_tokens
            if d.finish_reason is not None:
                self.finish[key] = d.finish_reason
                self.errors[key] = d.error
        self.changed.set()

    async def wait(self, pred, timeout=60.0):
        await wait_until(self.changed, pred, timeout)


@pytest.fixture
async def engine(tiny_model_dir):
    system = ActorSystem("engine-test")
    await system.start()
    cfg = EngineConfig(model=tiny_model_dir("qwen2"), dtype="float32", num_threads=1, block_size=16,
                       num_blocks=96, max_num_batched_tokens=64)
    eng = await start_engine(cfg, system)
    sink = Sink()
    sink_ref = await system.spawn(sink, name="sink")
    yield eng, sink, sink_ref
    await eng.stop()
    await system.shutdown()


async def test_requests_joining_a_running_batch_match_transformers(engine, tiny_model_dir):
    eng, sink, ref = engine
    batch = prompts(5)
    for i, p in enumerate(batch[:4]):
        eng.scheduler.tell(SubmitRequest(f"a{i}", p, GREEDY, ref))
    await sink.wait(lambda: any(sink.tokens.get((f"a{i}", 0)) for i in range(4)))
    for i, p in enumerate(batch[4:]):  # the first ones are decoding by now
        eng.scheduler.tell(SubmitRequest(f"b{i}", p, GREEDY, ref))
    ids = [f"a{i}" for i in range(4)] + [f"b{i}" for i in range(4)]
    await sink.wait(lambda: all((r, 0) in sink.finish for r in ids))
    assert len(sink.finish) == 8 and set(sink.finish.values()) == {"length"}
    assert [sink.tokens[(r, 0)] for r in ids] == hf_greedy(tiny_model_dir("qwen2"), batch)
    stats = await eng.scheduler.ask(GetStats())
    assert stats.generation_tokens == 8 * NUM_NEW and stats.prompt_tokens == sum(map(len, batch))
    assert stats.kv_blocks_free == stats.kv_blocks_total == 96
    assert sink.messages < 8 * NUM_NEW  # deltas of one step travel together


async def test_abort_frees_blocks_at_once(engine):
    eng, sink, ref = engine
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    eng.scheduler.tell(SubmitRequest("victim", list(range(4, 200)), long, ref))
    eng.scheduler.tell(SubmitRequest("other", list(range(10, 40)), long, ref))
    await sink.wait(lambda: len(sink.tokens.get(("victim", 0), [])) >= 3)
    before = await eng.scheduler.ask(GetStats())
    assert before.requests_running == 2 and before.kv_blocks_free < 96 - 13
    eng.scheduler.tell(AbortRequest("victim"))
    after = await eng.scheduler.ask(GetStats())  # handled right after the abort, before any step
    assert after.kv_blocks_free >= before.kv_blocks_free + 13  # its 13+ blocks are back
    assert after.requests_running == 1
    await sink.wait(lambda: ("victim", 0) in sink.finish)
    assert sink.finish[("victim", 0)] == "abort"
    eng.scheduler.tell(AbortRequest("other"))
    await sink.wait(lambda: ("other", 0) in sink.finish)
    final = await eng.scheduler.ask(GetStats())
    assert final.kv_blocks_free == 96 and final.requests_running == final.requests_waiting == 0


async def test_idle_scheduler_does_not_step(engine):
    eng, sink, ref = engine
    eng.scheduler.tell(SubmitRequest("one", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3), ref))
    await sink.wait(lambda: ("one", 0) in sink.finish)
    steps = (await eng.scheduler.ask(GetStats())).steps
    await asyncio.sleep(0.3)
    assert (await eng.scheduler.ask(GetStats())).steps == steps


async def test_loop_keeps_serving_while_the_forward_runs(engine, monkeypatch):
    eng, sink, ref = engine
    execute = ModelRunner.execute

    def slow_execute(self, batch):
        time.sleep(0.5)  # a long forward pass, blocking its thread
        return execute(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", slow_execute)
    eng.scheduler.tell(SubmitRequest("slow", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1), ref))
    ticks = 0
    while ("slow", 0) not in sink.finish:
        ticks += 1
        await asyncio.sleep(0.01)
    stats = await eng.scheduler.ask(GetStats())  # the scheduler answers between steps too
    assert stats.steps == 1
    assert ticks >= 10  # the event loop kept running during the half-second forward


async def test_unknown_abort_and_duplicate_ids_are_harmless(engine):
    eng, sink, ref = engine
    eng.scheduler.tell(AbortRequest("nobody"))
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.scheduler.tell(SubmitRequest("dup", [5, 6], p, ref))
    eng.scheduler.tell(SubmitRequest("dup", [7, 8], p, ref))
    eng.scheduler.tell(SubmitRequest("empty", [], p, ref))
    await sink.wait(lambda: ("dup", 0) in sink.finish and ("empty", 0) in sink.finish)
    assert len(sink.tokens[("dup", 0)]) == 4 and sink.finish[("empty", 0)] == "error"
    assert sink.errors[("empty", 0)] == "the prompt is empty"


class KVListener(Actor):
    def __init__(self):
        self.heard = asyncio.Event()

    async def receive(self, msg):
        assert isinstance(msg, KVEventsWaiting)
        self.heard.set()


async def test_kv_events_for_the_prefix_index_come_through_the_kv_actor(engine):
    """A subscriber hears that events are waiting; drained, they say which blocks were cached, and
    a snapshot taken after them starts where they end."""
    eng, sink, ref = engine
    listener = KVListener()
    eng.kv.tell(SubscribeKVEvents(await eng.system.spawn(listener, name="kv-listener")))
    await eng.kv.ask(DrainKVEvents())
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    eng.scheduler.tell(SubmitRequest("indexed", list(range(4, 54)), p, ref))  # 50 tokens: 3 full blocks
    await sink.wait(lambda: ("indexed", 0) in sink.finish)
    await asyncio.wait_for(listener.heard.wait(), 10)
    drained = await eng.kv.ask(DrainKVEvents())
    stored = [h for e in drained.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(stored) == 3 and drained.next_seq == drained.events[-1].seq + 1
    snapshot = await eng.kv.ask(GetKVSnapshot())
    assert snapshot.next_seq == drained.next_seq and sorted(snapshot.block_hashes) == sorted(stored)
    assert (await eng.kv.ask(GetKVStats())).num_cached_blocks == 3


async def test_the_loaded_heap_is_frozen_while_the_engine_runs(engine):
    """A full collection would walk every object the load left (torch, the model, the tokenizer) in the
    middle of a step; the engine takes them out of the collector's generations, and gives them back
    when it stops."""
    import gc

    eng, _, _ = engine
    frozen = gc.get_freeze_count()
    assert frozen > 10_000
    assert sum(gc.get_count()) < frozen
    await eng.stop()
    assert gc.get_freeze_count() == 0
