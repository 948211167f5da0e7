"""Decode bursts through a real engine (tiny random-weight model, float32): the same tokens as
step-by-step decoding and as transformers, every token streamed in its own delta, a new request
served at once rather than after the burst, and a step failing inside a burst costing nothing."""
from __future__ import annotations

import asyncio
import time

import pytest

from actors import LLM
from actors.config import EngineConfig
from actors.engine import start_engine
from actors.messages.front_end import SamplingParams, SubmitRequest, TokenDeltas
from actors.worker.model_runner import ModelRunner
from actors.worker.sampler import Sampler
from actors.worker.worker_actor import WorkerActor
from runtime import Actor, ActorSystem
from tests.actors.test_llm_parity import GREEDY, NUM_NEW, hf_greedy, prompts
from tests.actors.waiting import wait_until


def record_bursts(monkeypatch) -> list[tuple[int, int]]:
    """(plan.burst, forwards run) of every step the worker runs."""
    seen, step = [], WorkerActor.step

    def recorded(self, plan):
        result = step(self, plan)
        seen.append((plan.burst, result.num_steps))
        return result

    monkeypatch.setattr(WorkerActor, "step", recorded)
    return seen


def generate(folder: str, batch, params, burst: int) -> list[list[int]]:
    with LLM(folder, dtype="float32", num_threads=1, decode_burst=burst) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(batch, params)]


def test_bursts_decode_the_tokens_of_step_by_step_decoding_and_of_transformers(tiny_model_dir, monkeypatch):
    folder = tiny_model_dir("llama")
    batch = prompts(3, (5, 31, 64))
    seen = record_bursts(monkeypatch)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    bursting = generate(folder, batch, long, 8)
    assert any(steps > 1 for _, steps in seen)
    assert bursting == generate(folder, batch, long, 1)
    assert [t[:NUM_NEW] for t in bursting] == hf_greedy(folder, batch)


def test_seeded_sampling_draws_the_same_tokens_in_bursts(tiny_model_dir):
    folder = tiny_model_dir("llama")
    batch = prompts(4, (7, 20))
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=11, ignore_eos=True,
                            repetition_penalty=1.3)
    assert generate(folder, batch, params, 8) == generate(folder, batch, params, 1)


class Stream(Actor):
    """Each delta's tokens as it came, per request, with when it came."""

    def __init__(self):
        self.deltas: dict[str, list[tuple[float, list[int]]]] = {}
        self.finished: set[str] = set()
        self.changed = asyncio.Event()

    async def receive(self, msg):
        assert isinstance(msg, TokenDeltas)
        for d in msg.deltas:
            self.deltas.setdefault(d.request_id, []).append((time.monotonic(), list(d.token_ids)))
            if d.finish_reason is not None:
                self.finished.add(d.request_id)
        self.changed.set()

    def count(self, rid: str) -> int:
        return sum(len(t) for _, t in self.deltas.get(rid, []))

    async def wait(self, pred, timeout=60.0):
        await wait_until(self.changed, pred, timeout)


@pytest.fixture
async def bursting(tiny_model_dir, monkeypatch):
    """An engine whose bursts are long (64 steps) and whose forward is slowed to 5 ms, so a burst
    would hold a new request back for a third of a second if nothing ended it."""
    execute = ModelRunner.execute

    def slow(self, batch, *args):
        time.sleep(0.005)
        return execute(self, batch, *args)

    monkeypatch.setattr(ModelRunner, "execute", slow)
    system = ActorSystem("burst-test")
    await system.start()
    folder = tiny_model_dir("llama")
    eng = await start_engine(EngineConfig(model=folder, dtype="float32", num_threads=1, num_blocks=96,
                                          decode_burst=64), system)
    stream = Stream()
    ref = await system.spawn(stream, name="stream")
    yield eng, stream, ref, folder
    await eng.stop()
    await system.shutdown()


async def test_every_token_of_a_burst_streams_in_its_own_delta(bursting, monkeypatch):
    eng, stream, ref, folder = bursting
    seen = record_bursts(monkeypatch)
    prompt = prompts(5, (12,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eng.scheduler.tell(SubmitRequest("a", prompt, params, ref))
    await stream.wait(lambda: "a" in stream.finished)
    assert max(steps for _, steps in seen) == 39          # the prompt's token, then one burst
    assert [len(t) for _, t in stream.deltas["a"]] == [1] * 40
    assert [t for _, ts in stream.deltas["a"] for t in ts][:NUM_NEW] == hf_greedy(folder, [prompt])[0]


async def test_a_request_arriving_during_a_burst_starts_at_once(bursting):
    eng, stream, ref, folder = bursting
    first, second = prompts(6, (10, 20))
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    eng.scheduler.tell(SubmitRequest("long", first, long, ref))
    await stream.wait(lambda: stream.count("long") >= 4)   # the burst of 64 steps has begun
    before = stream.count("long")
    eng.scheduler.tell(SubmitRequest("new", second, GREEDY, ref))
    await stream.wait(lambda: stream.count("new") >= 1)
    # The brake ends the burst after the step it is in (and perhaps the one after, begun before the
    # request came): the new prompt runs in the next step, not 60 steps later.
    assert stream.count("long") - before <= 4
    await stream.wait(lambda: {"long", "new"} <= stream.finished)
    assert [t for _, ts in stream.deltas["new"] for t in ts] == hf_greedy(folder, [second])[0]
    assert [t for _, ts in stream.deltas["long"] for t in ts][:NUM_NEW] == hf_greedy(folder, [first])[0]


def test_a_step_failing_inside_a_burst_ends_the_burst_and_loses_nothing(tiny_model_dir, monkeypatch, capsys):
    """The third step of the first burst fails once, after its tokens were drawn: the burst ends
    with the two steps before it, the draws are undone, and the next ordinary step draws that
    token again, as if nothing had failed. The failure is logged once, with its traceback."""
    folder = tiny_model_dir("llama")
    batch = prompts(7, (9, 33))
    sample, burst, in_burst = Sampler.sample, WorkerActor._burst, []

    def flaky(self, *args):
        out = sample(self, *args)
        if in_burst:
            in_burst.append(None)
            if len(in_burst) == 3:   # the burst's own second step: its third
                raise RuntimeError("a transient failure")
        return out

    def first_burst(self, *args):
        in_burst.append(None)
        try:
            return burst(self, *args)
        finally:
            monkeypatch.setattr(WorkerActor, "_burst", burst)

    monkeypatch.setattr(Sampler, "sample", flaky)
    monkeypatch.setattr(WorkerActor, "_burst", first_burst)
    seen = record_bursts(monkeypatch)
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=5, ignore_eos=True)
    with LLM(folder, dtype="float32", num_threads=1, decode_burst=8) as llm:
        outs = llm.generate(batch, params)
    assert len(in_burst) >= 3 and (7, 2) in seen
    logged = [line for line in capsys.readouterr().err.splitlines() if "decode burst step failed" in line]
    assert len(logged) == 1 and "RuntimeError: a transient failure" in logged[0] and "Traceback" in logged[0]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    monkeypatch.setattr(Sampler, "sample", sample)
    assert [o.outputs[0].token_ids for o in outs] == generate(folder, batch, params, 1)
