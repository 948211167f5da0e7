"""Speculative steps in the scheduling policy, against the real KV manager and a paged fake model.

The fake target reads every token through the block tables (drafts included, written in the same
step) and keeps drafts while they equal its own next token, so a stale block table, a lost
rollback or a wrong position shows up as a wrong output. Outputs must equal plain decoding,
the policy's block tables must equal the manager's, and every block must come back.
"""
from __future__ import annotations

import random

from actors.draft.controller import SpecController
from actors.kv.kv_actor import apply_kv_step
from actors.messages import SeqOutput, StepPlan, StepResult
from actors.scheduler.policy import PolicyConfig, SchedulingPolicy
from tests.actors.test_scheduler_policy import EOS, Harness, PagedFake, next_token, prompts, reference


class SpecFake(PagedFake):
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
        return StepResult(plan.step_id, outs)


class SpecHarness(Harness):
    def __init__(self, *, wrong: float = 0.3, **kw):
        super().__init__(**kw)
        cfg = self.policy.cfg
        self.controller = SpecController(4, adaptive=False)
        self.policy = SchedulingPolicy(PolicyConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size,
                                                    cfg.max_model_len, cfg.eos_token_ids), self.controller)
        self.model = SpecFake(len(self.kv._pool.blocks), cfg.block_size)
        self.rng = random.Random(0)
        self.wrong = wrong
        self.drafted = 0

    def step(self) -> StepPlan:
        req = self.policy.schedule()
        while req is not None:
            req = self.policy.on_kv(apply_kv_step(self.kv, req))
        for seq in self.policy.running:  # after the trims: both sides agree on every table
            if self.kv.has_request(str(seq.seq_id)) and seq.block_table:
                assert seq.block_table == self.kv.block_table(str(seq.seq_id)), seq
        plan = self.policy.plan()
        propose = self.policy.take_propose()
        wanted = {d.seq_id: d.num_spec for d in propose.seqs if d.num_spec}
        for s in plan.seqs:
            if s.seq_id in wanted:
                seq = self.policy.seqs[s.seq_id]
                ctx, drafts = list(seq.token_ids), []
                for _ in range(wanted[s.seq_id]):
                    tok = next_token(ctx, seq.seed)
                    if self.rng.random() < self.wrong:
                        tok = (tok + 1) % (EOS - 1)
                    drafts.append(tok)
                    ctx.append(tok)
                s.spec_token_ids = drafts
                self.drafted += len(drafts)
        self.plans.append(plan)
        self.policy.update(self.model.run(plan))
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
    c = h.policy.counters
    assert h.drafted == c.spec_draft_tokens > 0
    assert 0 < c.spec_accepted_tokens < c.spec_draft_tokens
    h.assert_all_free()


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
    assert h.policy.counters.preemptions > 0
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
