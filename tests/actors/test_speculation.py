"""Speculative steps in the scheduler (its SpeculationPlanner), against the real KV manager and a paged fake model.

The fake target reads every token through the block tables (drafts included, written in the same
step) and keeps drafts while they equal its own next token, so a stale block table, a lost
rollback or a wrong position shows up as a wrong output. Outputs must equal plain decoding,
the plan's block tables must equal the manager's, and every block must come back.
"""
from __future__ import annotations

import random
import time

import pytest

from actors.draft.controller import SpecController
from actors.draft.messages import Propose
from actors.draft.proposer import _Table
from actors.kv.kv_actor import apply_kv_step
from actors.messages.kv import KVTrim
from actors.messages.step import SeqOutput, StepPlan, StepResult
from actors.scheduler.config import SchedulerConfig
from actors.scheduler.scheduler import Scheduler
from tests.actors.test_scheduler import EOS, FakeClock, Harness, PagedFake, next_token, prompts, reference


class SpecFake(PagedFake):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.accepted: list[int] = []   # per verification with drafts: how many the target kept

    def run(self, plan: StepPlan) -> StepResult:
        for new in plan.new_seqs:
            self.seeds[new.seq_id] = new.seed
        for sid in plan.finished_seq_ids:
            del self.seeds[sid]
        for s in plan.seqs:
            for i, tok in enumerate(s.token_ids + s.spec_token_ids):
                self.cache[self._slot(s.block_table, s.start_pos + i)] = tok
        outs = []
        for s in plan.seqs:
            if not s.sample:
                continue
            end = s.start_pos + len(s.token_ids)
            emitted = []
            for j in range(len(s.spec_token_ids) + 1):
                ctx = [self.cache[self._slot(s.block_table, p)] for p in range(end + j)]
                target = next_token(ctx, self.seeds[s.seq_id])
                emitted.append(target)
                if j == len(s.spec_token_ids) or s.spec_token_ids[j] != target:
                    break
            outs.append(SeqOutput(s.seq_id, emitted, None, len(s.spec_token_ids)))
            if s.spec_token_ids:
                self.accepted.append(len(emitted) - 1)
        return StepResult(plan.step_id, outs)


class SpecHarness(Harness):
    def __init__(self, *, wrong: float = 0.3, adaptive: bool = False, **kw):
        super().__init__(**kw)
        cfg = self.scheduler.cfg
        self.controller = SpecController(4, adaptive=adaptive, probe_interval=4)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size,
                                                    cfg.max_model_len, cfg.eos_token_ids), self.controller,
                                   clock=kw.get("clock", time.perf_counter))
        self.model = SpecFake(len(self.kv._pool.blocks), cfg.block_size)
        self.rng = random.Random(0)
        self.wrong = wrong
        self.drafted = 0
        self.listener = _Table(lambda new: None)              # hears what a draft worker would
        self.held_back = 0                                     # decode steps that sent it nothing

    def assert_all_free(self):
        super().assert_all_free()
        assert not self.listener.seqs and not self.listener._gone

    def step(self) -> StepPlan:
        req = self.scheduler.kv_transaction()
        while req is not None:
            req = self.scheduler.apply_kv_result(apply_kv_step(self.kv, req))
        plan = self.scheduler.plan()
        for s in plan.seqs:  # after the trims: the plan carries the manager's own tables
            assert s.block_table == self.kv.block_table(str(s.seq_id)), s
        propose = self.scheduler.speculation.take_propose()
        wanted = {d.seq_id: d.num_spec for d in propose.seqs if d.num_spec} if propose is not None else {}
        assert (propose is None) == (not wanted) or len(propose.seqs) >= self.scheduler.speculation.feed.max_queued
        if propose is not None:
            # A draft worker that hears only these messages still holds each drafting sequence's
            # whole history when it drafts: the held-back steps came with this one, in order.
            for d, held in self.listener.apply(propose):
                if d.num_spec:
                    end = d.start_pos + len(d.token_ids)
                    assert held.history == self.scheduler.seqs[d.seq_id].token_ids[:end]
        for s in plan.seqs:
            if s.seq_id in wanted:
                seq = self.scheduler.seqs[s.seq_id]
                ctx, drafts = list(seq.token_ids), []
                for _ in range(wanted[s.seq_id]):
                    tok = next_token(ctx, seq.seed)
                    if self.rng.random() < self.wrong:
                        tok = (tok + 1) % (EOS - 1)
                    drafts.append(tok)
                    ctx.append(tok)
                s.spec_token_ids = drafts
                self.drafted += len(drafts)
                self.listener.seqs[s.seq_id].history.extend(drafts)   # as a proposer keeps its own
        self.plans.append(plan)
        self.held_back += propose is None and any(s.sample for s in plan.seqs)
        self.scheduler.update(self.model.run(plan))
        self.listener.apply(Propose(0, [], [], self.scheduler.speculation.take_released()))   # as the actor's emit does
        self._collect()
        self.kv.check_invariants()
        return plan


def test_speculative_outputs_equal_plain_decoding_and_blocks_come_back():
    h = SpecHarness(num_blocks=256, block_size=4, budget=48)
    batch = prompts(8, lo=1, hi=60)
    for i, p in enumerate(batch):
        h.submit(f"r{i}", p, max_tokens=25, ignore_eos=True)
    h.run()
    for i, p in enumerate(batch):
        assert h.outputs[(f"r{i}", 0)] == reference(p, 25)
    c = h.scheduler.counters
    assert h.drafted == c.spec_decode_draft_tokens > 0
    assert 0 < c.spec_decode_accepted_tokens < c.spec_decode_draft_tokens
    h.assert_all_free()


def test_steps_without_drafts_send_the_draft_worker_nothing_and_lose_no_history():
    # Drafts that are always wrong: the adaptive controller switches speculation off and probes now
    # and then, so most decode steps draft nothing; their tokens reach the draft with the next probe.
    h = SpecHarness(num_blocks=256, block_size=4, budget=48, wrong=1.0, adaptive=True)
    batch = prompts(6, lo=1, hi=40, seed=7)
    for i, p in enumerate(batch):
        h.submit(f"r{i}", p, max_tokens=40, ignore_eos=True)
    h.run()
    for i, p in enumerate(batch):
        assert h.outputs[(f"r{i}", 0)] == reference(p, 40)
    assert h.held_back > 20 and h.scheduler.counters.spec_decode_num_drafts > 0
    h.assert_all_free()


def test_a_sequence_that_ends_before_the_draft_heard_of_it_is_never_mentioned():
    h = SpecHarness(num_blocks=256, block_size=4, budget=48, wrong=1.0, adaptive=True)
    h.controller._engine.successes = 0.0     # new sequences start switched off
    p = prompts(1, lo=30, hi=30, seed=2)[0]
    h.submit("short", p, max_tokens=3, ignore_eos=True)
    h.run()
    assert h.outputs[("short", 0)] == reference(p, 3)
    assert h.scheduler.counters.spec_decode_num_drafts == 0
    h.assert_all_free()


def test_draft_feed_holds_back_in_order_and_bounds_its_queue():
    from actors.draft.messages import DraftInput
    from actors.messages.front_end import SamplingParams
    from actors.messages.step import NewSequence
    from actors.scheduler.draft_feed import DraftFeed

    feed = DraftFeed(max_queued=5)
    new = NewSequence(1, [1, 2, 3], SamplingParams(), None)
    assert feed.step(1, [DraftInput(1, [1, 2, 3], 0, [0], 0)], [new]) is None
    assert feed.step(2, [DraftInput(1, [4], 3, [0], 0)], []) is None
    sent = feed.step(3, [DraftInput(1, [5], 4, [0], 2)], [])
    assert [d.start_pos for d in sent.seqs] == [0, 3, 4] and sent.new_seqs == [new] and feed.num_queued == 0
    for step in range(4, 9):
        out = feed.step(step, [DraftInput(1, [step], step, [0], 0)], [])
    assert out is not None and len(out.seqs) == 5          # the bound sends the queue without a draft
    assert feed.release(1) is True and feed.release(1) is False
    feed.step(9, [DraftInput(2, [1], 0, [0], 0)], [NewSequence(2, [1], SamplingParams(), None)])
    assert feed.release(2) is False and feed.num_queued == 0   # never sent: dropped, not announced
    assert feed.step(10, [DraftInput(3, [1], 0, [0], 1)], []).new_seqs == []


def test_preemption_and_aborts_with_drafts_in_flight():
    h = SpecHarness(num_blocks=40, block_size=4, budget=32, wrong=0.5)
    batch = prompts(8, lo=5, hi=40, seed=3)
    for i, p in enumerate(batch):
        h.submit(f"r{i}", p, max_tokens=30, ignore_eos=True, seed=i)
    for _ in range(12):
        h.step()
    h.abort("r1")
    h.abort("r6")
    h.run()
    assert h.scheduler.counters.preemptions > 0
    for i, p in enumerate(batch):
        if i not in (1, 6):
            assert h.outputs[(f"r{i}", 0)] == reference(p, 30, seed=i)
    assert h.finish[("r1", 0)] == "abort"
    h.assert_all_free()
    assert h.controller.num_tracked == 0


def test_drafts_stop_at_max_tokens_and_eos():
    h = SpecHarness(wrong=0.0)
    p = prompts(1, lo=10, hi=10, seed=5)[0]
    h.submit("a", p, max_tokens=7, ignore_eos=True)
    h.run()
    assert h.outputs[("a", 0)] == reference(p, 7)
    # 1 token from the prefill, 4 drafts + 1 bonus, then room for one token: no draft for it.
    assert [len(s.spec_token_ids) for plan in h.plans for s in plan.seqs if len(s.token_ids) == 1] == [4, 0]
    h.assert_all_free()


def test_accepted_tokens_are_counted_per_draft_position():
    h = SpecHarness(num_blocks=256, block_size=4, budget=48, wrong=0.3)
    for i, p in enumerate(prompts(6, lo=1, hi=40, seed=5)):
        h.submit(f"r{i}", p, max_tokens=30, ignore_eos=True)
    h.run()
    c = h.scheduler.counters
    assert len(c.spec_decode_accepted_per_pos) == 4                    # one per position the controller drafts
    assert sum(c.spec_decode_accepted_per_pos) == c.spec_decode_accepted_tokens > 0
    # A draft whose first a tokens were kept counts once at each of positions 0..a-1.
    assert c.spec_decode_accepted_per_pos == [sum(a > pos for a in h.model.accepted) for pos in range(4)]
    assert c.spec_decode_num_drafts == len(h.model.accepted) >= c.spec_decode_accepted_per_pos[0]
    assert c.spec_decode_accepted_per_pos[0] > c.spec_decode_accepted_per_pos[3] > 0   # later positions are kept less often
    h.assert_all_free()


def test_inter_token_latency_is_observed_once_per_token_of_a_speculative_step():
    clock = FakeClock()
    h = SpecHarness(num_blocks=64, block_size=4, budget=48, wrong=0.0, clock=clock)
    h.submit("a", [3, 4, 5, 6], max_tokens=21, ignore_eos=True)
    steps = 0
    while h.scheduler.has_work():
        clock.t += 0.5
        h.step()
        steps += 1
    assert len(h.outputs[("a", 0)]) == 21 and steps == 5   # the first token, then 4 steps of 4 drafts + 1
    itl = h.scheduler.latency.recent_itl
    assert itl.count() == 20 and itl.quantiles(0.5, 0.9) == [pytest.approx(0.1)] * 2   # 0.5 s over 5 tokens
    assert h.scheduler.latency.recent_ttft.quantiles(0.5) == [pytest.approx(0.5)]


def test_the_planner_caps_k_at_a_sequences_room_and_trims_what_was_rejected():
    from actors.messages.front_end import SamplingParams
    from actors.messages.step import NewSequence, ScheduledSeq
    from actors.scheduler.counters import Counters
    from actors.scheduler.sequence import RequestState, Sequence
    from actors.scheduler.speculation import SpeculationPlanner

    counters = Counters()
    planner = SpeculationPlanner(SpecController(4, adaptive=False), counters, max_model_len=64)
    req = RequestState("r", [1, 2, 3], SamplingParams(max_tokens=3), None, 0, 0, None, 64)
    seq, prefilling = Sequence(0, req, 0), Sequence(1, req, 1)
    seq.token_ids.append(9)            # one output token out, its KV not computed: it decodes
    seq.num_computed = 3
    assert planner.choose([seq, prefilling]) == {0: 1}   # two tokens of room: one drafted, one to verify
    seq.spec_k = 1
    planner.scheduled(seq, ScheduledSeq(0, [9], 3, [0], True))
    planner.planned(1, [NewSequence(0, [1, 2, 3], SamplingParams(), None)])
    assert [d.num_spec for d in planner.take_propose().seqs] == [1] and planner.take_propose() is None
    assert planner.verified(seq, 1, 0, running=True) == [KVTrim(0, 3)] and seq.spec_k == 0
    assert (counters.spec_decode_draft_tokens, counters.spec_decode_accepted_tokens, counters.spec_decode_num_drafts) == (1, 0, 1)
    assert planner.verified(seq, 1, 1, running=False) == [] and counters.spec_decode_accepted_per_pos == [1, 0, 0, 0]
    planner.forget(seq)
    assert planner.take_released() == [0]   # the draft worker heard of it: it drops its state
