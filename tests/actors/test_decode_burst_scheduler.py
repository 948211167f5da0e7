"""Decode bursts in the scheduler, with the real KV manager and the paged fake model.

The harness plays the worker's part of a burst: after the planned step it runs up to `plan.burst`
more decode steps itself, each from the token the one before sampled, into the plan's block tables
(the lookahead slots), handing every step's tokens but the last's to `progress`. The fake reads the
whole context back through the tables, so a wrong slot or a lost token changes the output.
"""
from __future__ import annotations

import dataclasses

from actors.kv.kv_actor import apply_kv_step
from actors.messages.step import ScheduledSeq, SeqOutput, StepPlan
from tests.actors.test_scheduler import Harness, prompts, reference


class BurstHarness(Harness):
    def __init__(self, max_burst: int, brake_after: int | None = None, **kw):
        super().__init__(**kw)
        self.scheduler.cfg = dataclasses.replace(self.scheduler.cfg, max_burst=max_burst)
        self.brake_after = brake_after   # burst steps after which the brake is pulled (None: never)
        self.forwards = 0
        self.grows = []                  # every KV transaction's grows

    def step(self) -> StepPlan:
        req = self.scheduler.kv_transaction()
        while req is not None:
            self.grows.append(req.grows)
            res = apply_kv_step(self.kv, req)
            for g in req.grows[:len(res.grown)]:   # what a grow holds: its KV, then its lookahead
                seq_id = str(g.seq_id)
                held = self.kv.num_computed_tokens(seq_id) + g.num_lookahead_tokens
                assert len(self.kv.block_table(seq_id)) == -(-held // self.kv.block_size), g
            req = self.scheduler.apply_kv_result(res)
        plan = self.scheduler.plan()
        self.plans.append(plan)
        result, seqs = self.model.run(plan), plan.seqs
        self.forwards += 1
        for done in range(plan.burst):
            if self.brake_after is not None and done >= self.brake_after:
                break
            last = {o.seq_id: o.token_ids[-1] for o in result.outputs}
            seqs = [ScheduledSeq(s.seq_id, [last[s.seq_id]], s.start_pos + len(s.token_ids), s.block_table, True)
                    for s in seqs]
            self.scheduler.progress(plan.step_id, result.outputs)
            self._collect()
            steps = result.num_steps
            result = self.model.run(StepPlan(plan.step_id, seqs))
            result.num_steps = steps + 1
            self.forwards += 1
        self.scheduler.update(result)
        self._collect()
        self.kv.check_invariants()
        return plan


def test_bursts_decode_exactly_and_give_every_block_back():
    h = BurstHarness(max_burst=8, budget=128)
    ps = prompts(6, 1, 40)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, max_tokens=10 + 7 * i)
    h.run()
    for i, p in enumerate(ps):
        assert h.outputs[(f"r{i}", 0)] == reference(p, 10 + 7 * i)
        assert h.finish[(f"r{i}", 0)] == "length"
    assert max(p.burst for p in h.plans) == 7
    assert h.scheduler.counters.steps == h.forwards > len(h.plans)   # every forward counts as a step
    h.assert_all_free()


def test_a_burst_reserves_its_lookahead_and_never_runs_past_a_requests_room():
    h = BurstHarness(max_burst=8)
    h.submit("a", [5, 6, 7], max_tokens=12)
    h.run()
    assert h.outputs[("a", 0)] == reference([5, 6, 7], 12)
    # prefill, then a burst of 8 decode steps (7 of lookahead), then one of 3 for the last 3 tokens
    assert [p.burst for p in h.plans] == [0, 7, 2]
    assert [g.num_lookahead_tokens for grows in h.grows for g in grows] == [7, 2]
    h.assert_all_free()


def test_nothing_bursts_beside_a_prompt_in_progress():
    h = BurstHarness(max_burst=8, budget=16)
    h.submit("short", [1, 2, 3], max_tokens=40)
    h.step()
    h.submit("long", list(range(100)), max_tokens=3)   # 100 tokens at 16 a step: several chunks
    h.run()
    chunked = [p for p in h.plans if any(len(s.token_ids) > 1 for s in p.seqs)]
    assert len(chunked) >= 7 and all(p.burst == 0 for p in chunked)
    assert max(p.burst for p in h.plans) == 7
    assert h.outputs[("short", 0)] == reference([1, 2, 3], 40)
    assert h.outputs[("long", 0)] == reference(list(range(100)), 3)
    h.assert_all_free()


def test_nothing_bursts_while_a_request_waits():
    h = BurstHarness(max_burst=8, max_seqs=1)
    h.submit("first", [1, 2, 3], max_tokens=20)
    h.submit("second", [4, 5, 6], max_tokens=20)   # waits: one sequence at a time
    while ("first", 0) not in h.finish:
        assert h.step().burst == 0
    h.run()
    assert max(p.burst for p in h.plans) == 7      # the second, alone, bursts
    assert h.outputs[("first", 0)] == reference([1, 2, 3], 20)
    assert h.outputs[("second", 0)] == reference([4, 5, 6], 20)
    h.assert_all_free()


def test_a_sequence_that_stops_inside_a_burst_ends_there_and_the_others_go_on():
    h = BurstHarness(max_burst=16)
    stop_at = reference([9, 9, 9], 30)
    h.submit("stops", [9, 9, 9], max_tokens=30, stop_token_ids=[stop_at[4]])
    h.submit("goes", [4, 4], max_tokens=30)
    h.run()
    assert h.outputs[("stops", 0)] == stop_at[:stop_at.index(stop_at[4]) + 1]
    assert h.finish[("stops", 0)] == "stop"
    assert h.outputs[("goes", 0)] == reference([4, 4], 30)
    h.assert_all_free()


def test_a_burst_braked_early_gives_its_unused_slots_back():
    h = BurstHarness(max_burst=16, brake_after=2, block_size=4)
    h.submit("a", [1, 2, 3, 4, 5], max_tokens=40)
    h.run()
    assert h.outputs[("a", 0)] == reference([1, 2, 3, 4, 5], 40)
    # each burst ran 3 of the 16 forwards it reserved slots for (the harness checks, at every
    # transaction, that the sequence holds no block past its KV and the step's lookahead)
    assert [p.burst for p in h.plans[:4]] == [0, 15, 15, 15]
    assert h.forwards == 1 + 39 and len(h.plans) == 1 + 13
    h.assert_all_free()


def test_progress_of_a_step_no_longer_in_flight_is_ignored():
    h = BurstHarness(max_burst=4)
    h.submit("a", [1, 2], max_tokens=20)
    h.step()
    h.step()
    stale = h.plans[-1]
    tokens = list(h.outputs[("a", 0)])
    assert h.scheduler.progress(stale.step_id, [SeqOutput(stale.seqs[0].seq_id, [7])]) == []
    h._collect()
    assert h.outputs[("a", 0)] == tokens
