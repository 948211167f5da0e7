"""Batch lines as ballast in the scheduler (actors/scheduler/ballast.py), with the real KV manager
and the paged fake model of test_scheduler: ballast never takes a row, a token or a block an
interactive request could take, is preempted first, backs off past the latency objective, and
still computes exactly what it would alone; a LoRA adapter slot it holds goes to an interactive
request at once."""
from __future__ import annotations

import dataclasses
import random

import msgspec

from actors.messages.front_end import SamplingParams, SubmitRequest
from actors.scheduler.ballast import BallastObjective, BallastPolicy, count_rows
from actors.scheduler.config import SchedulerConfig
from actors.scheduler.counters import Counters
from actors.scheduler.latency import LatencyMeter
from actors.scheduler.scheduler import Scheduler
from actors.scheduler.sequence import RequestState, Sequence
from tests.actors.test_scheduler import Harness, reference


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def submit(h: Harness, rid: str, prompt: list[int], ballast: bool = False, priority: int = 0, max_tokens: int = 8):
    h.scheduler.add(SubmitRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), "client", priority,
                                  ballast=ballast))
    h._collect()


def ids(seqs, ballast: bool) -> set[str]:
    return {s.request.request_id for s in seqs if s.request.ballast is ballast}


def test_an_interactive_request_takes_a_ballast_row_at_once():
    h = Harness(max_seqs=2, budget=64)
    submit(h, "b0", [1] * 6, ballast=True, max_tokens=30)
    submit(h, "b1", [2] * 6, ballast=True, max_tokens=30)
    h.step()
    assert ids(h.scheduler.running, True) == {"b0", "b1"}
    submit(h, "chat", [3] * 6, max_tokens=5)
    h.step()
    assert "chat" in ids(h.scheduler.running, False)
    assert ids(h.scheduler.waiting, True) == {"b1"}   # the newest ballast gave its row back
    h.run()
    for rid, tok, n in (("b0", 1, 30), ("b1", 2, 30), ("chat", 3, 5)):
        assert h.outputs[(rid, 0)] == reference([tok] * 6, n)
    h.assert_all_free()


def test_ballast_prefill_waits_while_an_interactive_prompt_waits():
    h = Harness(budget=8, block_size=4)
    submit(h, "batch", list(range(1, 41)), ballast=True, max_tokens=2)   # 40 tokens: five 8-token chunks
    h.step()
    submit(h, "chat", list(range(50, 62)), max_tokens=2)                   # 12 tokens
    plan = h.step()
    by_id = {h.scheduler.seqs[s.seq_id].request.request_id: len(s.token_ids) for s in plan.seqs}
    assert by_id == {"chat": 8}   # the whole budget, though the batch line started first
    h.run()
    assert h.outputs[("batch", 0)] == reference(list(range(1, 41)), 2)
    assert h.outputs[("chat", 0)] == reference(list(range(50, 62)), 2)
    h.assert_all_free()


def test_ballast_is_preempted_first_whatever_its_priority():
    h = Harness(num_blocks=12, block_size=4, budget=64, max_model_len=48)
    submit(h, "batch-old", [2] * 8, ballast=True, priority=-10, max_tokens=30)
    submit(h, "chat-low", [1] * 8, priority=10, max_tokens=30)
    submit(h, "chat-new", [3] * 8, max_tokens=30)
    h.step()
    victims = h.step_until_preempted()
    assert victims[0] == "batch-old"
    h.run()
    for rid, tok in (("chat-low", 1), ("batch-old", 2), ("chat-new", 3)):
        assert h.outputs[(rid, 0)] == reference([tok] * 8, 30)
    h.assert_all_free()


def test_an_interactive_request_gets_the_blocks_ballast_holds():
    h = Harness(num_blocks=10, block_size=4, budget=64, max_seqs=8)
    submit(h, "batch", [5] * 30, ballast=True, max_tokens=8)   # 8 of the 10 blocks
    h.step()
    submit(h, "chat", [6] * 12, max_tokens=4)                    # needs 3 or 4
    h.step()
    assert ids(h.scheduler.running, False) == {"chat"} and ids(h.scheduler.waiting, True) == {"batch"}
    h.run()
    assert h.outputs[("chat", 0)] == reference([6] * 12, 4)
    assert h.outputs[("batch", 0)] == reference([5] * 30, 8)
    h.assert_all_free()


def test_ballast_backs_off_past_the_objective_and_runs_alone_at_full_speed():
    clock = Clock()
    h = Harness(budget=64)
    h.scheduler = Scheduler(SchedulerConfig(16, 64, 4, 512, ballast=BallastObjective(itl_s=0.05)), clock=clock)
    submit(h, "chat", [1] * 6, max_tokens=12)
    submit(h, "batch", [2] * 6, ballast=True, max_tokens=12)
    while h.scheduler.latency.interactive_itl.count() == 0:   # quick steps: both run
        clock.t += 0.01
        h.step()
    assert ids(h.scheduler.running, True) == {"batch"}
    clock.t += 1.0   # a slow step: interactive ITL is now past the objective
    h.step()
    for _ in range(3):
        plan = h.step()
        assert {h.scheduler.seqs[s.seq_id].request.ballast for s in plan.seqs} == {False}
    h.run()   # once the interactive request is done, the batch line runs whatever the latency
    assert h.outputs[("batch", 0)] == reference([2] * 6, 12)
    assert h.outputs[("chat", 0)] == reference([1] * 6, 12)
    h.assert_all_free()


def test_ballast_never_holds_a_row_or_prefill_an_interactive_request_waits_for():
    """Random arrivals of both classes, rows and budget scarce: after every step, interactive
    requests still waiting have rows to spare unless no ballast runs, and no step that left one
    waiting gave a ballast prompt a chunk."""
    rng = random.Random(7)
    h = Harness(num_blocks=512, block_size=4, budget=24, max_seqs=4)
    expected = {}
    for i in range(60):
        if rng.random() < 0.5:
            ballast = rng.random() < 0.5
            prompt = [rng.randrange(998) for _ in range(rng.randint(1, 40))]
            rid = f"{'b' if ballast else 'i'}{i}"
            submit(h, rid, prompt, ballast=ballast, max_tokens=rng.randint(1, 12))
            expected[rid] = reference(prompt, h.scheduler.requests[rid].max_output)
        plan = h.step()
        s = h.scheduler
        waiting = [q for q in s.waiting if not q.request.ballast]
        if waiting and ids(s.running, True):
            assert len(s.running) + len(waiting) <= s.cfg.max_num_seqs
        if waiting:   # waiting before the step too: only ballast decodes may have run
            for seq in plan.seqs:
                owner = s.seqs.get(seq.seq_id)
                assert owner is None or not owner.request.ballast or len(seq.token_ids) == 1
    h.run()
    for rid, tokens in expected.items():
        assert h.outputs[(rid, 0)] == tokens
    h.assert_all_free()


def test_an_interactive_request_takes_the_adapter_slot_ballast_holds_at_once():
    h = Harness(max_seqs=8, budget=64)
    h.scheduler.cfg = dataclasses.replace(h.scheduler.cfg, max_loras=1)
    for i in range(3):   # batch lines under adapter "a" hold the one slot
        h.scheduler.add(SubmitRequest(f"b{i}", [i + 1] * 6, SamplingParams(max_tokens=30), "client", ballast=True,
                                      lora_name="a"))
    h.scheduler.add(SubmitRequest("base", [9] * 6, SamplingParams(max_tokens=30), "client", ballast=True))
    h._collect()
    h.step()
    assert ids(h.scheduler.running, True) == {"b0", "b1", "b2", "base"}
    h.scheduler.add(SubmitRequest("chat", [7] * 6, SamplingParams(max_tokens=5), "client", lora_name="b"))
    h._collect()
    h.step()
    # The adapter's batch lines gave the slot back; the base model's keeps its row.
    assert "chat" in ids(h.scheduler.running, False)
    assert ids(h.scheduler.running, True) == {"base"} and ids(h.scheduler.waiting, True) == {"b0", "b1", "b2"}
    h.run()
    for rid, tok, n in (("b0", 1, 30), ("b1", 2, 30), ("b2", 3, 30), ("base", 9, 30), ("chat", 7, 5)):
        assert h.outputs[(rid, 0)] == reference([tok] * 6, n)
    h.assert_all_free()


class CostedHarness(Harness):
    """Each step's forward takes FIXED + PER_ROW x rows, as a CPU's decode does: the scheduler reads
    the cost of a row from what its steps report."""
    FIXED, PER_ROW = 0.05, 0.01

    def __init__(self, slack: float, **kw):
        super().__init__(**kw)
        cfg = dataclasses.replace(self.scheduler.cfg, ballast=BallastObjective(step_slack=slack))
        self.scheduler = Scheduler(cfg)
        run = self.model.run
        self.model.run = lambda plan: msgspec.structs.replace(run(plan), forward_s=self.seconds(plan))

    def seconds(self, plan) -> float:
        return self.FIXED + self.PER_ROW * sum(len(s.token_ids) for s in plan.seqs)


def test_ballast_beside_interactive_decodes_keeps_their_step_within_its_slack():
    h = CostedHarness(slack=0.3, max_seqs=16, budget=64)
    for i in range(8):
        submit(h, f"b{i}", [10 + i] * 4, ballast=True, max_tokens=60)
    for _ in range(3):
        h.step()   # 8 ballast rows alone, at full speed
    ballast_ids = {s.seq_id for s in h.scheduler.running}
    assert len(h.plans[-1].seqs) == 8
    submit(h, "chat0", [1] * 4, max_tokens=30)
    submit(h, "chat1", [2] * 4, max_tokens=30)
    capped = 0
    while not {("chat0", 0), ("chat1", 0)} <= h.finish.keys():
        known = h.scheduler.ballast.cost.line() is not None   # the cost of a row, when the step was planned
        plan = h.step()
        batch = sum(len(s.token_ids) for s in plan.seqs if s.seq_id in ballast_ids)
        chat = sum(len(s.token_ids) for s in plan.seqs) - batch
        if chat and known:
            capped += 1
            alone = h.FIXED + h.PER_ROW * chat
            assert h.seconds(plan) <= 1.3 * alone + 1e-9, (chat, batch)
            assert batch >= 1   # the slack holds a row or more: ballast still moves
    assert capped >= 20
    h.run()   # alone again: every line finishes, as it would have
    for i in range(8):
        assert h.outputs[(f"b{i}", 0)] == reference([10 + i] * 4, 60)
    for i in range(2):
        assert h.outputs[(f"chat{i}", 0)] == reference([1 + i] * 4, 30)
    h.assert_all_free()


def test_no_slack_keeps_ballast_out_of_interactive_steps_and_none_starts_beside_an_interactive_prompt():
    h = CostedHarness(slack=0.0, max_seqs=16, budget=64)
    submit(h, "batch", [3] * 6, ballast=True, max_tokens=20)
    submit(h, "chat", [4] * 6, max_tokens=20)
    plan = h.step()
    assert [h.scheduler.seqs[s.seq_id].request.request_id for s in plan.seqs] == ["chat"]
    h.run()
    assert h.outputs[("batch", 0)] == reference([3] * 6, 20)
    assert h.outputs[("chat", 0)] == reference([4] * 6, 20)
    h.assert_all_free()


def _seqs(specs: list[tuple[bool, str | None]]):
    """Sequences in sort order, one per (ballast, LoRA adapter), each of its own request."""
    out = []
    for i, (ballast, lora) in enumerate(specs):
        req = RequestState(f"r{i}", [1, 2], SamplingParams(), "client", 0, i, None, 64, ballast, lora)
        out.append(Sequence(i, req, 0))
    return sorted(out, key=lambda s: s.sort_key)


def _policy() -> BallastPolicy:
    return BallastPolicy(BallastObjective(), LatencyMeter(Counters(), Clock()))


def test_displaced_ballast_gives_rows_then_adapter_slots_the_newest_first_each_once():
    running = _seqs([(False, None), (True, "a"), (True, None), (True, "a")])   # r1, r3 under "a"; r2 base
    waiting = _seqs([(False, "b"), (False, None)])
    rows_only = _policy().displaced(running, waiting, max_num_seqs=5, max_loras=0, keep=set())
    assert [s.request.request_id for s in rows_only] == ["r3"]   # one row short: the newest ballast
    both = _policy().displaced(running, waiting, max_num_seqs=5, max_loras=1, keep=set())
    assert [s.request.request_id for s in both] == ["r3", "r1"]   # and adapter "a"'s slot, r3 counted once
    kept = _policy().displaced(running, waiting, max_num_seqs=5, max_loras=1, keep={3})
    assert [s.request.request_id for s in kept] == ["r1"]   # a fork parent keeps its blocks
    assert _policy().displaced(running, [], max_num_seqs=4, max_loras=1, keep=set()) == []


def test_count_rows_counts_the_ballast_among_a_steps_sequences():
    seqs = _seqs([(True, None), (False, None), (True, None)])
    assert count_rows(seqs + [None]) == 2 and count_rows([]) == 0
