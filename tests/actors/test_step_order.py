"""The step's order, through a real engine: while the worker computes a step, Submit and Abort keep
arriving, and an Abort that came during the forward is applied before that step's outputs go out."""
from __future__ import annotations

import asyncio
import threading

import pytest

from actors.config import EngineConfig
from actors.engine import start_engine
from actors.messages import AbortRequest, GetStats, SubmitRequest
from actors.worker.model_runner import ModelRunner
from runtime import ActorSystem
from tests.actors.test_engine import Sink
from tests.actors.test_llm_parity import GREEDY, hf_greedy, prompts


@pytest.fixture
async def engine(tiny_model_dir):
    folder = tiny_model_dir("llama")
    system = ActorSystem("step-order")
    await system.start()
    cfg = EngineConfig(model=folder, dtype="float32", num_threads=1, block_size=16, num_blocks=96,
                       max_num_batched_tokens=256)
    eng = await start_engine(cfg, system)
    sink = Sink()
    ref = await system.spawn(sink, name="sink")
    yield eng, sink, ref, folder
    await eng.stop()
    await system.shutdown()


async def test_submit_and_abort_during_the_forward_apply_before_its_outputs(engine, monkeypatch):
    eng, sink, ref, folder = engine
    execute, entered, release = ModelRunner.execute, threading.Event(), threading.Event()

    def held_execute(self, batch, *args):
        entered.set()
        release.wait(30)
        return execute(self, batch, *args)

    monkeypatch.setattr(ModelRunner, "execute", held_execute)
    held, later = prompts(2, (16, 40))
    eng.scheduler.tell(SubmitRequest("held", held, GREEDY, ref))
    assert await asyncio.to_thread(entered.wait, 30)
    eng.scheduler.tell(AbortRequest("held"))
    eng.scheduler.tell(SubmitRequest("later", later, GREEDY, ref))
    stats = await eng.scheduler.ask(GetStats())   # answered while the forward is held
    assert stats.steps == 1 and stats.requests_waiting == 1
    release.set()
    await sink.wait(lambda: ("later", 0) in sink.finish and ("held", 0) in sink.finish)
    assert sink.finish[("held", 0)] == "abort" and sink.tokens[("held", 0)] == []  # its step's token never went out
    assert sink.tokens[("later", 0)] == hf_greedy(folder, [later])[0]
    stats = await eng.scheduler.ask(GetStats())
    assert stats.kv_blocks_free == stats.kv_blocks_total
