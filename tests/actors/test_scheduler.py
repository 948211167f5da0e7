"""The scheduler with the real KV manager and a paged fake model, no event loop.

The fake model writes each computed token into a paged "cache" through the plan's block tables
and draws the next token from the whole context it reads back through them, so any wrong block
table, early free or bad fork changes the output; outputs are compared with a direct reference.
"""
from __future__ import annotations

import time

import pytest

from actors.kv.kv_actor import apply_kv_free, apply_kv_step
from actors.kv.manager import KVCacheManager
from actors.kv.structs import KVCacheConfig
from actors.messages.front_end import SamplingParams, SubmitRequest
from actors.messages.step import ScheduledSeq, SeqOutput, StepPlan, StepResult
from actors.scheduler.config import SchedulerConfig
from actors.scheduler.scheduler import Scheduler

VOCAB = 1000
EOS = 999


def next_token(context: list[int], seed: int | None) -> int:
    return (sum((t + 1) * (i + 1) for i, t in enumerate(context)) + 7 * (seed or 0)) % (VOCAB - 1)


def reference(prompt: list[int], max_tokens: int, seed: int | None = None) -> list[int]:
    ctx = list(prompt)
    for _ in range(max_tokens):
        ctx.append(next_token(ctx, seed))
    return ctx[len(prompt):]


class PagedFake:
    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.cache: list[int | None] = [None] * (num_blocks * block_size)
        self.seeds: dict[int, int | None] = {}

    def run(self, plan: StepPlan) -> StepResult:
        for new in plan.new_seqs:
            self.seeds[new.seq_id] = new.seed
        for sid in plan.finished_seq_ids:
            del self.seeds[sid]
        for s in plan.seqs:  # all KV writes first, as in a forward pass
            self.write(s, s.token_ids)
        outs = []
        for s in plan.seqs:
            if s.sample:
                end = s.start_pos + len(s.token_ids)
                ctx = [self.cache[self._slot(s.block_table, p)] for p in range(end)]
                outs.append(SeqOutput(s.seq_id, [next_token(ctx, self.seeds[s.seq_id])]))
        return StepResult(plan.step_id, outs)

    def write(self, s: ScheduledSeq, token_ids: list[int]) -> None:
        for i, tok in enumerate(token_ids):
            self.cache[self._slot(s.block_table, s.start_pos + i)] = tok

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs


class Harness:
    def __init__(self, num_blocks=256, block_size=4, budget=64, max_seqs=16, max_model_len=512,
                 prefix_caching=True, clock=time.perf_counter):
        self.kv = KVCacheManager(KVCacheConfig(num_blocks, block_size, prefix_caching))
        self.scheduler = Scheduler(SchedulerConfig(max_seqs, budget, block_size, max_model_len, frozenset({EOS}),
                                                    priority_scheduling=True), clock=clock)
        self.model = PagedFake(num_blocks, block_size)
        self.outputs: dict[tuple[str, int], list[int]] = {}
        self.finish: dict[tuple[str, int], str] = {}
        self.plans: list[StepPlan] = []

    def submit(self, rid, prompt, priority=0, **params):
        params.setdefault("max_tokens", 8)
        self.scheduler.add(SubmitRequest(rid, prompt, SamplingParams(**params), "client", priority))
        self._collect()

    def step(self) -> StepPlan:
        req = self.scheduler.kv_transaction()
        while req is not None:
            req = self.scheduler.apply_kv_result(apply_kv_step(self.kv, req))
        plan = self.scheduler.plan()
        self.plans.append(plan)
        self.scheduler.update(self.model.run(plan))
        self._collect()
        self.kv.check_invariants()
        return plan

    def abort(self, rid):
        self.scheduler.abort(rid)
        self._collect()

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                return
            self.step()
        raise AssertionError("did not finish")

    def _collect(self):
        frees = self.scheduler.take_frees()
        if frees is not None:
            apply_kv_free(self.kv, frees)
        for ref, deltas in self.scheduler.take_deltas().items():
            assert ref == "client"
            for d in deltas:
                key = (d.request_id, d.index)
                assert key not in self.finish, "delta after the finish"
                self.outputs.setdefault(key, []).extend(d.token_ids)
                if d.finish_reason:
                    self.finish[key] = d.finish_reason

    def step_until_preempted(self) -> list[str]:
        """Steps until a step sends running requests back to waiting; their ids."""
        seq_of = {s.request.request_id: s for s in self.scheduler.seqs.values()}
        victims = []
        while not victims:
            running = {s.request.request_id for s in self.scheduler.running}
            self.step()
            victims = [r for r in running if seq_of[r] in self.scheduler.waiting]
        return victims

    def assert_all_free(self):
        assert self.kv.num_seqs == 0
        assert self.kv.num_free_blocks == self.kv.num_total_blocks
        assert not self.scheduler.requests and not self.scheduler.seqs


def prompts(n, lo=1, hi=300, seed=1):
    import random
    rng = random.Random(seed)
    lengths = [lo, hi] + [rng.randint(lo, hi) for _ in range(n - 2)]
    return [[rng.randrange(VOCAB - 1) for _ in range(L)] for L in lengths]


def test_mixed_batch_matches_reference_and_frees_everything():
    h = Harness(budget=128)
    ps = prompts(10)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, max_tokens=5 + i)
    h.run()
    for i, p in enumerate(ps):
        assert h.outputs[(f"r{i}", 0)] == reference(p, 5 + i)
        assert h.finish[(f"r{i}", 0)] == "length"
    h.assert_all_free()


def test_chunked_prefill_respects_budget_and_keeps_decodes_running():
    h = Harness(budget=16)
    h.submit("short", [1, 2, 3], max_tokens=40)
    h.step()
    h.step()
    h.submit("long", list(range(300)), max_tokens=3)
    decoding_steps = 0
    while ("long", 0) not in h.finish:
        plan = h.step()
        assert sum(len(s.token_ids) for s in plan.seqs) <= 16
        ids = {s.seq_id for s in plan.seqs}
        if ("short", 0) not in h.finish:
            assert 0 in ids, "a long prefill stalled a running decode"
            decoding_steps += 1
    assert decoding_steps >= 10  # the 300-token prompt took many chunks, decode went on
    h.run()
    assert h.outputs[("long", 0)] == reference(list(range(300)), 3)
    assert h.outputs[("short", 0)] == reference([1, 2, 3], 40)
    h.assert_all_free()


def test_preemption_by_recompute_keeps_outputs_exact():
    h = Harness(num_blocks=40, block_size=4, budget=64, max_model_len=160)
    ps = prompts(8, 1, 60, seed=3)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, max_tokens=30)
    h.run()
    assert h.scheduler.counters.preemptions > 0
    for i, p in enumerate(ps):
        assert h.outputs[(f"r{i}", 0)] == reference(p, 30)
    h.assert_all_free()


def test_every_plan_carries_the_kv_managers_block_tables():
    """Through preemptions and n > 1 forks, the scheduler keeps no tables of its own: each planned
    table is the manager's, as it stands after the step's transaction."""
    h = Harness(num_blocks=40, block_size=4, budget=64, max_model_len=160)
    planned = 0
    plan = h.scheduler.plan

    def checked_plan():
        nonlocal planned
        out = plan()
        for s in out.seqs:
            assert s.block_table == h.kv.block_table(str(s.seq_id)), s
            planned += 1
        return out

    h.scheduler.plan = checked_plan
    ps = prompts(8, 1, 60, seed=4)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, max_tokens=20, n=2 if i % 3 == 0 else 1, seed=i)
    h.run()
    assert h.scheduler.counters.preemptions > 0 and planned > 0
    for i, p in enumerate(ps):
        for j in range(2 if i % 3 == 0 else 1):
            assert h.outputs[(f"r{i}", j)] == reference(p, 20, i + j)
    h.assert_all_free()


def test_priority_is_ignored_unless_priority_scheduling_is_on():
    """As in vLLM: first come, first served by default; a client's priority orders nothing."""
    for enabled, order in ((False, ["early", "late-urgent"]), (True, ["late-urgent", "early"])):
        scheduler = Scheduler(SchedulerConfig(4, 64, 4, 512, priority_scheduling=enabled))
        scheduler.add(SubmitRequest("early", [1, 2, 3], SamplingParams(), "client", 0))
        scheduler.add(SubmitRequest("late-urgent", [4, 5, 6], SamplingParams(), "client", -5))
        assert [s.request.request_id for s in scheduler.waiting] == order


def test_preemption_picks_lowest_priority_then_newest():
    h = Harness(num_blocks=12, block_size=4, budget=64, max_model_len=48)
    h.submit("important-old", [1] * 8, priority=0, max_tokens=30)
    h.submit("batch", [2] * 8, priority=5, max_tokens=30)
    h.submit("important-new", [3] * 8, priority=0, max_tokens=30)
    h.step()
    victims = h.step_until_preempted()
    assert victims[0] == "batch"
    h.run()
    for rid, tok in (("important-old", 1), ("batch", 2), ("important-new", 3)):
        assert h.outputs[(rid, 0)] == reference([tok] * 8, 30)
    h.assert_all_free()


def test_prefix_cache_hits_skip_prefill():
    h = Harness(block_size=4, budget=256)
    system = list(range(100, 164))
    h.submit("first", system + [1, 2], max_tokens=4)
    h.run()
    computed_before = sum(len(s.token_ids) for p in h.plans for s in p.seqs)
    h.submit("second", system + [5, 6, 7], max_tokens=4)
    h.run()
    computed_second = sum(len(s.token_ids) for p in h.plans for s in p.seqs) - computed_before
    assert h.scheduler.counters.prefix_cache_hit_tokens == 64
    assert computed_second == 3 + 3  # the 3 new prompt tokens, then 3 decodes
    assert h.outputs[("second", 0)] == reference(system + [5, 6, 7], 4)
    h.assert_all_free()


def test_n_samples_share_prompt_blocks():
    h = Harness(block_size=4, budget=256)
    prompt = list(range(10, 33))  # 23 tokens: 5 full blocks shared, the partial one recomputed
    h.submit("multi", prompt, n=3, seed=11, max_tokens=6)
    h.step()
    h.step()
    tables = [h.kv.block_table(str(s.seq_id)) for s in h.scheduler.running]
    assert len(tables) == 3
    assert tables[1][:5] == tables[0][:5] == tables[2][:5]
    h.run()
    for i in range(3):
        assert h.outputs[("multi", i)] == reference(prompt, 6, 11 + i)
    h.assert_all_free()


def test_a_forked_samples_blocks_are_cached_under_its_own_tokens():
    """A later prompt that continues sample 1's text hits every full block sample 1 computed,
    past the prompt blocks it shared: the manager hashed the sample's own tokens."""
    h = Harness(block_size=4, budget=256)
    prompt = list(range(10, 33))  # 23 tokens: 5 full blocks shared by the samples
    h.submit("multi", prompt, n=2, seed=11, max_tokens=12)
    h.run()
    text = prompt + h.outputs[("multi", 1)]   # 35 tokens, the last one never computed
    hits_before = h.scheduler.counters.prefix_cache_hit_tokens
    h.submit("continue", text, max_tokens=3)
    h.run()
    assert h.scheduler.counters.prefix_cache_hit_tokens - hits_before == 32
    assert h.outputs[("continue", 0)] == reference(text, 3)
    h.assert_all_free()


def test_abort_frees_blocks_at_once_and_ends_the_stream():
    h = Harness(block_size=4, budget=256)
    h.submit("a", list(range(40)), max_tokens=50)
    h.submit("b", list(range(50, 70)), max_tokens=50)
    h.step()
    h.step()
    free_before = h.kv.num_free_blocks
    h.abort("a")
    assert h.kv.num_free_blocks > free_before
    assert h.finish[("a", 0)] == "abort"
    h.abort("missing")  # unknown ids are ignored
    h.run()
    assert h.outputs[("b", 0)] == reference(list(range(50, 70)), 50)
    h.assert_all_free()


def test_abort_while_waiting_and_n_before_fork():
    h = Harness(block_size=4, budget=8, max_seqs=1)
    h.submit("run", [1, 2, 3], max_tokens=20)
    h.submit("wait", [4, 5, 6], max_tokens=20, n=2)
    h.step()
    h.abort("wait")
    assert h.finish[("wait", 0)] == h.finish[("wait", 1)] == "abort"  # every sample hears of it
    h.run()
    h.assert_all_free()


def test_stop_conditions():
    ctx = [5, 6, 7]
    ref = reference(ctx, 10)
    h = Harness()
    h.submit("stop-id", ctx, max_tokens=10, stop_token_ids=[ref[3]])
    h.submit("ctx-len", list(range(500)), max_tokens=None)
    h.submit("too-long", list(range(512)), max_tokens=5)
    h.run()
    assert h.outputs[("stop-id", 0)] == ref[:4] and h.finish[("stop-id", 0)] == "stop"
    assert len(h.outputs[("ctx-len", 0)]) == 12 and h.finish[("ctx-len", 0)] == "length"
    assert h.outputs[("too-long", 0)] == [] and h.finish[("too-long", 0)] == "length"
    h.assert_all_free()


def test_eos_unless_ignored():
    # Find a prompt whose second generated token is EOS under the fake model.
    prompt = None
    for a in range(2000):
        cand = [a, 3]
        first = next_token(cand, None)
        if next_token(cand + [first], None) == EOS % (VOCAB - 1):
            prompt = cand
            break
    if prompt is None:
        pytest.skip("no prompt reaches the fake EOS")
    eos = reference(prompt, 2)[1]
    h = Harness()
    h.scheduler.cfg = SchedulerConfig(16, 64, 4, 512, frozenset({eos}))
    h.submit("stops", prompt, max_tokens=10)
    h.submit("ignores", prompt, max_tokens=10, ignore_eos=True)
    h.run()
    assert h.outputs[("stops", 0)] == reference(prompt, 2) and h.finish[("stops", 0)] == "stop"
    assert h.outputs[("ignores", 0)] == reference(prompt, 10)


def test_max_num_seqs_caps_the_batch():
    h = Harness(max_seqs=3, budget=512)
    for i in range(7):
        h.submit(f"r{i}", [i + 1] * 5, max_tokens=6)
    while h.scheduler.has_work():
        plan = h.step()
        assert len(plan.seqs) <= 3
    for i in range(7):
        assert h.outputs[(f"r{i}", 0)] == reference([i + 1] * 5, 6)
    h.assert_all_free()


def test_abort_one_sample_keeps_the_others():
    h = Harness(block_size=4, budget=256)
    prompt = list(range(10, 30))
    h.submit("multi", prompt, n=3, seed=5, max_tokens=12)
    h.step()  # prompt computed, sample 0 drew its first token; samples 1 and 2 are forked
    h.scheduler.abort("multi", 0)  # the parent goes before its forks are applied
    h.step()
    h.scheduler.abort("multi", 2)
    h._collect()
    h.run()
    assert h.finish[("multi", 0)] == "abort" and h.finish[("multi", 2)] == "abort"
    assert h.outputs[("multi", 1)] == reference(prompt, 12, 6)
    h.assert_all_free()


def test_min_tokens_holds_off_every_eos_id_the_engine_stops_on():
    """The sampler masks the engine's own EOS ids (model and tokenizer), whoever submitted the
    request: a front end never has to know them."""
    h = Harness()
    h.submit("held", [1, 2, 3], min_tokens=2)
    h.submit("free", [4, 5, 6], min_tokens=2, ignore_eos=True)
    h.submit("plain", [7, 8, 9])
    params = {rid: h.scheduler.requests[rid].params for rid in ("held", "free", "plain")}
    assert params["held"].eos_token_ids == [EOS]
    assert params["free"].eos_token_ids == [] and params["plain"].eos_token_ids == []


def test_queue_time_is_measured_once_per_request_from_arrival_to_first_scheduled():
    h = Harness(num_blocks=40, block_size=4, budget=64, max_model_len=160)
    ps = prompts(8, 1, 60, seed=3)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, max_tokens=30)
    h.step()
    waits = h.scheduler.counters.queue_time
    assert 0 < waits.count < len(ps)   # a 64-token budget admits some of them in the first step
    h.run()
    assert h.scheduler.counters.preemptions > 0
    assert waits.count == len(ps)      # a preempted request's second wait is not counted again
    assert 0 <= waits.sum < 60


def test_a_started_prefill_that_sorts_first_never_takes_a_decodes_turn():
    """An important request's long prompt arrives while a less important one streams: the prompt is
    chunked into what the budget leaves after the decode, so the stream gets a token every step."""
    h = Harness(budget=16)
    h.submit("streaming", [1, 2, 3], priority=5, max_tokens=30)
    h.step()
    h.step()
    h.submit("urgent", list(range(200)), priority=0, max_tokens=2)
    steps = 0
    while h.scheduler.seqs and any(s.request.request_id == "urgent" and s.num_output_tokens == 0
                                   for s in h.scheduler.seqs.values()):
        plan = h.step()
        steps += 1
        assert sum(len(s.token_ids) for s in plan.seqs) <= 16
        assert 0 in {s.seq_id for s in plan.seqs}, f"step {steps}: the urgent prefill stalled the stream"
    assert steps >= 200 // 15
    h.run()
    assert h.outputs[("urgent", 0)] == reference(list(range(200)), 2)
    assert h.outputs[("streaming", 0)] == reference([1, 2, 3], 30)
    h.assert_all_free()


def test_a_wave_of_prompts_is_prefilled_first_come_first_served():
    """Prompts that arrive together are computed in arrival order, each chunk to the earliest prompt
    still unfinished: the budget is never spread over the queue, so early prompts get their first
    token early (prompt k's at the step where the k first prompts' tokens have all been computed)."""
    budget, plen = 64, 40
    h = Harness(budget=budget, max_seqs=32)
    for i in range(10):
        h.submit(f"r{i}", prompts(1, plen, plen, seed=i)[0], max_tokens=50)
    first_token_step = {}
    for step in range(1, 40):
        h.step()
        for (rid, _), toks in h.outputs.items():
            first_token_step.setdefault(rid, step) if toks else None
        if len(first_token_step) == 10:
            break
    order = sorted(first_token_step, key=lambda r: (first_token_step[r], int(r[1:])))
    assert order == [f"r{i}" for i in range(10)]
    # Decodes take one token each from every step's budget, and prompts follow in order with what is left.
    done, decoding, step_of = 0, 0, {}
    for step in range(1, 40):
        left = budget - decoding
        while done < 10 * plen and left > 0:
            take = min(left, plen - done % plen)
            done += take
            left -= take
            if done % plen == 0:
                step_of[f"r{done // plen - 1}"] = step
        decoding = len(step_of)
        if len(step_of) == 10:
            break
    assert first_token_step == step_of


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t
