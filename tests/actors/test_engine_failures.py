"""One request's failure is its own: through a real engine (and with n-gram speculative decoding, so
the rejection sampler's path too), a sequence the step fails for ends alone with finish_reason
"error" while the rest of its batch decodes exactly as without it; a step that fails for everyone
ends every request with "error", and the engine serves the next request normally.

Failures are injected with a small wrapper around the real model runner or sampler that raises for
the request marked by POISON, a special token id the random prompts never hold.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from actors import LLM
from actors.config import EngineConfig
from actors.engine import start_engine
from actors.kv.kv_actor import apply_kv_step
from actors.messages.front_end import GetStats, SamplingParams, SubmitRequest
from actors.messages.step import SeqOutput, StepPlan
from actors.scheduler.requests import EMPTY_PROMPT
from actors.scheduler.scheduler import SEQUENCE_FAILED
from actors.worker.model_runner import ModelRunner
from actors.worker.sampler import Sampler
from runtime import ActorSystem
from tests.actors.conftest import TINY_VOCAB
from tests.actors.test_engine import Sink
from tests.actors.test_llm_parity import GREEDY, NUM_NEW, hf_greedy, prompts
from tests.actors.test_scheduler import Harness, reference
from tests.actors.test_spec_engine import repetitive

POISON = 3
GARBAGE = -1  # what a failed forward leaves in the paged fake's KV slots
STEP_FAILED = "internal error: the engine step failed"
# Repetitive prompts, so that the n-gram proposer drafts and the rejection sampler verifies.
GOOD = [repetitive(40, 7, 1), repetitive(33, 5, 2)] + prompts(3, (16, 64))
# Requests a test fails while they decode: far more tokens than the test waits for, so that none can
# reach its length limit in the moment between the test seeing their first tokens and breaking the step.
DOOMED = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)


@pytest.fixture(params=[None, "ngram"], ids=["plain", "ngram"])
async def engine(request, tiny_model_dir):
    folder = tiny_model_dir("llama")
    system = ActorSystem("failures")
    await system.start()
    spec = None if request.param is None else {"method": request.param, "num_speculative_tokens": 3,
                                               "adaptive": False, "disable_batch_size": None}
    cfg = EngineConfig(model=folder, dtype="float32", num_threads=1, block_size=16, num_blocks=96,
                       max_num_batched_tokens=256, speculative=spec)
    eng = await start_engine(cfg, system)
    sink = Sink()
    ref = await system.spawn(sink, name="sink")
    yield eng, sink, ref, folder
    await eng.stop()
    await system.shutdown()


def poisoned(n: int, seed: int) -> list[int]:
    return [POISON] + repetitive(n, 6, seed)


async def run_batch(eng, sink, ref, batch: dict[str, tuple[list[int], SamplingParams]]) -> None:
    for rid, (prompt, params) in batch.items():
        eng.scheduler.tell(SubmitRequest(rid, prompt, params, ref))
    await sink.wait(lambda: all((rid, 0) in sink.finish for rid in batch), timeout=120)


async def assert_good_unharmed(eng, sink, folder: str, spec: bool) -> None:
    assert [sink.tokens[(f"good{i}", 0)] for i in range(len(GOOD))] == hf_greedy(folder, GOOD)
    assert all(sink.finish[(f"good{i}", 0)] == "length" for i in range(len(GOOD)))
    stats = await eng.scheduler.ask(GetStats())
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert (stats.spec_decode_draft_tokens > 0) == spec


def good_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    return {f"good{i}": (p, GREEDY) for i, p in enumerate(GOOD)}


@pytest.mark.parametrize("penalty", [1e-38, 1e-45])
async def test_a_tiny_repetition_penalty_harms_no_other_request(engine, penalty):
    eng, sink, ref, folder = engine
    bad = SamplingParams(temperature=1.0, repetition_penalty=penalty, max_tokens=NUM_NEW, ignore_eos=True, seed=0)
    await run_batch(eng, sink, ref, {**good_requests(), "bad": (repetitive(30, 6, 3), bad)})
    await assert_good_unharmed(eng, sink, folder, eng.draft is not None)
    assert sink.finish[("bad", 0)] == "length"  # the sampler is total: no error to report at all
    assert len(sink.tokens[("bad", 0)]) == NUM_NEW and all(0 <= t < TINY_VOCAB for t in sink.tokens[("bad", 0)])


def fail_when_poisoned(monkeypatch, phase: str) -> None:
    """The real forward (or sampler) raises whenever the poisoned request is in its batch."""
    if phase == "forward":
        execute = ModelRunner.execute

        def failing_execute(self, batch, *args):
            if any(POISON in s.token_ids for s in batch.seqs):
                raise RuntimeError("injected forward failure")
            return execute(self, batch, *args)

        monkeypatch.setattr(ModelRunner, "execute", failing_execute)
        return
    for name in ("sample", "processed_probs"):  # plain sampling, and verification of drafts
        real = getattr(Sampler, name)

        def failing(self, logits, states, *args, _real=real):
            if any(int(s.prompt_token_ids[0]) == POISON for s in states):
                raise RuntimeError("injected sampling failure")
            return _real(self, logits, states, *args)

        monkeypatch.setattr(Sampler, name, failing)


@pytest.mark.parametrize("phase", ["forward", "sampling"])
async def test_a_failure_traced_to_one_sequence_ends_it_alone(engine, monkeypatch, phase):
    eng, sink, ref, folder = engine
    fail_when_poisoned(monkeypatch, phase)
    await run_batch(eng, sink, ref, {**good_requests(), "bad": (poisoned(30, 3), GREEDY)})
    assert sink.finish[("bad", 0)] == "error" and sink.errors[("bad", 0)] == SEQUENCE_FAILED
    assert sink.tokens[("bad", 0)] == []
    await assert_good_unharmed(eng, sink, folder, eng.draft is not None)


@pytest.mark.parametrize("engine", [None], ids=["plain"], indirect=True)
async def test_a_token_outside_the_vocabulary_ends_its_sequence_alone(engine, monkeypatch):
    eng, sink, ref, folder = engine
    sample = Sampler.sample

    def sample_past_the_vocabulary(self, logits, states, *args):
        out = sample(self, logits, states, *args)
        return out._replace(token_ids=[logits.shape[1] if int(s.prompt_token_ids[0]) == POISON else t
                                       for s, t in zip(states, out.token_ids)])

    monkeypatch.setattr(Sampler, "sample", sample_past_the_vocabulary)
    await run_batch(eng, sink, ref, {**good_requests(), "bad": (poisoned(30, 3), GREEDY)})
    assert sink.finish[("bad", 0)] == "error" and sink.tokens[("bad", 0)] == []
    await assert_good_unharmed(eng, sink, folder, False)


def breakable_forward(monkeypatch) -> list[bool]:
    """The real forward, failing for every batch while the returned switch is on."""
    execute = ModelRunner.execute
    broken = [False]

    def failing_execute(self, batch, *args):
        if broken[0]:
            raise RuntimeError("injected failure of the whole forward")
        return execute(self, batch, *args)

    monkeypatch.setattr(ModelRunner, "execute", failing_execute)
    return broken


async def test_a_step_that_fails_for_everyone_errors_every_request_and_the_engine_goes_on(engine, monkeypatch):
    eng, sink, ref, folder = engine
    broken = breakable_forward(monkeypatch)
    doomed = {f"doomed{i}": (p, DOOMED) for i, p in enumerate(GOOD[:3])}
    for rid, (prompt, params) in doomed.items():
        eng.scheduler.tell(SubmitRequest(rid, prompt, params, ref))
    await sink.wait(lambda: all(sink.tokens.get((rid, 0)) for rid in doomed))  # all decoding together
    broken[0] = True
    await sink.wait(lambda: all((rid, 0) in sink.finish for rid in doomed))
    assert {sink.finish[(rid, 0)] for rid in doomed} == {"error"}
    expected = hf_greedy(folder, GOOD[:3])
    made = [sink.tokens[(rid, 0)][:NUM_NEW] for rid in doomed]  # the reference holds NUM_NEW tokens
    assert all(expected[i][:len(m)] == m for i, m in enumerate(made))
    assert {sink.errors[(rid, 0)] for rid in doomed} == {STEP_FAILED}
    broken[0] = False
    await run_batch(eng, sink, ref, good_requests())
    await assert_good_unharmed(eng, sink, folder, eng.draft is not None)


class _Unhandled:
    """A message the scheduler does not handle: it fails, and its supervisor restarts it."""


def held_forward(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The worker's forward waits for `release`; `entered` is set once a step reached it."""
    execute, entered, release = ModelRunner.execute, threading.Event(), threading.Event()

    def held_execute(self, batch, *args):
        entered.set()
        release.wait(30)
        return execute(self, batch, *args)

    monkeypatch.setattr(ModelRunner, "execute", held_execute)
    return entered, release


@pytest.mark.parametrize("engine", [None], ids=["plain"], indirect=True)
async def test_a_scheduler_restarted_during_its_step_serves_the_next_requests(engine, monkeypatch):
    eng, sink, ref, folder = engine
    entered, release = held_forward(monkeypatch)
    eng.scheduler.tell(SubmitRequest("during", GOOD[0], GREEDY, ref))
    assert await asyncio.to_thread(entered.wait, 30)
    eng.scheduler.tell(_Unhandled())          # restarts the scheduler while its step runs
    release.set()
    await run_batch(eng, sink, ref, good_requests())
    assert sink.finish[("during", 0)] == "error"   # the interrupted step's outcome never comes
    await assert_good_unharmed(eng, sink, folder, False)


async def test_blocks_a_failed_step_never_wrote_are_not_served_from_the_prefix_cache(engine, monkeypatch):
    eng, sink, ref, folder = engine
    broken = breakable_forward(monkeypatch)
    broken[0] = True
    await run_batch(eng, sink, ref, {"early": (GOOD[3], GREEDY)})  # its 4 full blocks were hashed, not written
    assert sink.finish[("early", 0)] == "error" and sink.errors[("early", 0)] == SEQUENCE_FAILED  # alone in its step
    broken[0] = False
    await run_batch(eng, sink, ref, good_requests())
    await assert_good_unharmed(eng, sink, folder, eng.draft is not None)


@pytest.mark.parametrize("failure", ["alone", "whole step"])
async def test_another_tenants_cached_prompt_stays_hot_after_a_failure(engine, monkeypatch, failure):
    eng, sink, ref, folder = engine
    broken = breakable_forward(monkeypatch)
    warm, doomed = GOOD[0], GOOD[1:3] if failure == "whole step" else GOOD[1:2]
    await run_salted(eng, sink, ref, {"warm": (warm, "tenant-a")})
    for i, prompt in enumerate(doomed):
        eng.scheduler.tell(SubmitRequest(f"doomed{i}", prompt, DOOMED, ref, cache_salt="tenant-b"))
    if failure == "whole step":  # both decode together, then a step fails for both
        await sink.wait(lambda: all(sink.tokens.get((f"doomed{i}", 0)) for i in range(len(doomed))))
    broken[0] = True
    await sink.wait(lambda: all((f"doomed{i}", 0) in sink.finish for i in range(len(doomed))))
    assert {sink.finish[(f"doomed{i}", 0)] for i in range(len(doomed))} == {"error"}
    broken[0] = False
    hits = (await eng.scheduler.ask(GetStats())).prefix_cache_hit_tokens
    again = {f"again{i}": (p, "tenant-b") for i, p in enumerate(doomed)}
    await run_salted(eng, sink, ref, {"warm-again": (warm, "tenant-a"), **again})
    assert sink.cached[("warm-again", 0)] == full_blocks(warm)
    assert (await eng.scheduler.ask(GetStats())).prefix_cache_hit_tokens - hits >= full_blocks(warm)
    # A failed prefill wrote none of its blocks; decodes that failed found the prompt's blocks written.
    assert sink.cached[("again0", 0)] == (full_blocks(doomed[0]) if failure == "whole step" else 0)
    assert [sink.tokens[(rid, 0)] for rid in ["warm-again", *again]] == hf_greedy(folder, [warm, *doomed])


def full_blocks(prompt: list[int]) -> int:
    """The most of a prompt the prefix cache can serve (blocks of 16, one token left to compute)."""
    return (len(prompt) - 1) // 16 * 16


async def run_salted(eng, sink, ref, batch: dict[str, tuple[list[int], str]]) -> None:
    for rid, (prompt, salt) in batch.items():
        eng.scheduler.tell(SubmitRequest(rid, prompt, GREEDY, ref, cache_salt=salt))
    await sink.wait(lambda: all((rid, 0) in sink.finish for rid in batch), timeout=120)


class FailingModel:
    """The scheduler test's paged fake, except that the sequences in `victims` fail, as the worker
    reports a sequence it traced a step's failure to: their KV slots get garbage, and the rest of
    the batch runs again without them."""

    def __init__(self, model):
        self.model = model
        self.victims: set[int] = set()

    def run(self, plan):
        failed = [s for s in plan.seqs if s.seq_id in self.victims]
        for s in failed:
            self.model.write(s, [GARBAGE] * len(s.token_ids))
        rest = [s for s in plan.seqs if s.seq_id not in self.victims]
        result = self.model.run(StepPlan(plan.step_id, rest, plan.new_seqs, plan.finished_seq_ids))
        result.outputs += [SeqOutput(s.seq_id, [], None, 0, "Traceback ...") for s in failed]
        return result

    def fail(self, h, request_id):
        self.victims.add(h.scheduler.requests[request_id].seqs[0].seq_id)


def test_a_failed_sample_ends_alone_and_its_siblings_go_on():
    h = Harness()
    h.model = model = FailingModel(h.model)
    prompt = list(range(10, 30))
    h.submit("multi", prompt, n=3, max_tokens=6, seed=1)
    h.submit("other", list(range(40, 50)), max_tokens=6)
    while len(h.scheduler.requests["multi"].seqs) < 3:
        h.step()
    model.victims.add(h.scheduler.requests["multi"].seqs[1].seq_id)
    h.run()
    assert h.finish[("multi", 1)] == "error"
    assert h.finish[("multi", 0)] == h.finish[("multi", 2)] == h.finish[("other", 0)] == "length"
    assert h.outputs[("multi", 0)] == reference(prompt, 6, 1) and h.outputs[("multi", 2)] == reference(prompt, 6, 3)
    assert h.outputs[("other", 0)] == reference(list(range(40, 50)), 6)
    h.assert_all_free()


def test_a_leader_failing_before_its_samples_start_ends_them_all():
    h = Harness()
    h.model = model = FailingModel(h.model)
    h.submit("multi", list(range(10, 30)), n=2, max_tokens=6, seed=1)
    model.victims.add(h.scheduler.requests["multi"].seqs[0].seq_id)
    h.run()
    assert h.finish[("multi", 0)] == h.finish[("multi", 1)] == "error"  # no sample waits forever
    h.assert_all_free()


PROMPT = list(range(10, 31))  # five full blocks of the harness's 4, and one token more


def test_a_sequence_failing_in_decode_keeps_the_blocks_earlier_steps_wrote():
    h = Harness()
    h.model = model = FailingModel(h.model)
    h.submit("a", PROMPT, max_tokens=8)
    for _ in range(3):  # the prefill, then decodes at positions 21 and 22
        h.step()
    model.fail(h, "a")
    h.step()  # position 23 fills block 5, hashed at allocation and never written
    assert h.finish[("a", 0)] == "error"
    h.assert_all_free()
    resumed = PROMPT + reference(PROMPT, 3) + [5]
    hits = h.scheduler.counters.prefix_cache_hit_tokens
    h.submit("again", resumed, max_tokens=4)
    h.run()
    assert h.scheduler.counters.prefix_cache_hit_tokens - hits == 20  # blocks 0-4, not the failed step's block 5
    assert h.outputs[("again", 0)] == reference(resumed, 4)


def test_a_request_that_hit_blocks_a_failed_one_was_writing_fails_with_it():
    h = Harness()
    h.model = model = FailingModel(h.model)
    h.submit("a", PROMPT, max_tokens=4)
    h.submit("b", PROMPT, max_tokens=4)  # admitted in a's step, its hit maps a's five new blocks
    model.fail(h, "a")
    h.step()
    assert h.finish[("a", 0)] == h.finish[("b", 0)] == "error" and h.outputs[("b", 0)] == []
    h.submit("again", PROMPT, max_tokens=4)
    h.run()
    assert h.outputs[("again", 0)] == reference(PROMPT, 4)
    h.assert_all_free()


def test_a_sequence_aborted_during_its_failed_step_forgets_what_it_never_wrote():
    h = Harness()
    h.model = model = FailingModel(h.model)
    h.submit("a", PROMPT, max_tokens=4)
    model.fail(h, "a")
    kv_step = h.scheduler.kv_transaction()
    h.scheduler.apply_kv_result(apply_kv_step(h.kv, kv_step))
    plan = h.scheduler.plan()
    h.abort("a")  # while the worker computes the step: its blocks go back at once
    assert h.finish[("a", 0)] == "abort" and h.kv.num_seqs == 0
    h.scheduler.update(model.run(plan))
    h._collect()
    h.submit("again", PROMPT, max_tokens=4)
    h.run()
    assert h.outputs[("again", 0)] == reference(PROMPT, 4)
    h.assert_all_free()


def test_failing_every_request_and_an_empty_prompt_say_error_not_abort():
    h = Harness(max_seqs=1)
    h.submit("empty", [], n=2)
    assert h.finish[("empty", 0)] == h.finish[("empty", 1)] == "error"
    h.submit("running", [1, 2, 3], max_tokens=20)
    h.submit("waiting", [4, 5, 6], max_tokens=20, n=2)
    h.step()
    h.scheduler.fail_all("internal error")
    h._collect()
    assert {h.finish[k] for k in [("running", 0), ("waiting", 0), ("waiting", 1)]} == {"error"}
    h.assert_all_free()
    h.submit("next", [7, 8], max_tokens=4)
    h.run()
    assert h.outputs[("next", 0)] == reference([7, 8], 4) and h.finish[("next", 0)] == "length"


def test_llm_reports_a_failed_sample_as_finish_reason_error(tiny_model_dir, monkeypatch):
    folder = tiny_model_dir("llama")
    fail_when_poisoned(monkeypatch, "forward")
    with LLM(folder, dtype="float32", num_threads=1, num_blocks=64) as llm:
        outs = llm.generate([poisoned(20, 4), GOOD[3], []], GREEDY)
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].error == SEQUENCE_FAILED
    assert outs[1].outputs[0].token_ids == hf_greedy(folder, GOOD[3:4])[0]
    assert outs[1].outputs[0].finish_reason == "length" and outs[1].outputs[0].error is None
    assert outs[2].outputs[0].finish_reason == "error" and outs[2].outputs[0].error == EMPTY_PROMPT
