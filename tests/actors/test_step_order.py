"""The step's order, through a real engine: while the worker computes a step, Submit and Abort keep
arriving, and an Abort that came during the forward is applied before that step's outputs go out."""
from __future__ import annotations

import asyncio

from actors.messages.front_end import AbortRequest, GetStats, SubmitRequest
from tests.actors.test_engine_failures import engine, held_forward  # noqa: F401 (a fixture)
from tests.actors.test_llm_parity import GREEDY, hf_greedy, prompts


async def test_submit_and_abort_during_the_forward_apply_before_its_outputs(engine, monkeypatch):  # noqa: F811
    eng, sink, ref, folder = engine
    entered, release = held_forward(monkeypatch)
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
