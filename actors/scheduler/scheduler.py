"""The scheduler: which sequences run in the next step and how many tokens each computes.

A plain synchronous class. Each step: `kv_transaction()` picks the batch and returns the KV
manager's transaction for it (running decodes first, then the prefills already started, in priority
order, then waiting ones as prefill chunks in queue order, under the token budget);
`apply_kv_result()` applies its result and, when the pool ran out, preempts the least important,
newest sequence and returns a retry; `plan()` turns the step into the worker's StepPlan, with the
block tables the KV manager returned (the scheduler keeps none); `update()` takes the sampled
tokens, stops sequences and queues the TokenDeltas for their front ends. It never awaits.

Admission, the budget and preemption are here, over the two queues (waiting, running); the rest is
delegated: the requests' bookkeeping and what their ends send out to a RequestTable (requests.py),
speculative decoding to a SpeculationPlanner (speculation.py), how far a decode burst goes to
bursts.py, disaggregation to a HandoffTracker (handoffs.py), and which rows, tokens and blocks batch
lines (ballast) may take to a BallastPolicy (ballast.py).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from actors.draft.controller import SpecController
from actors.messages.front_end import SubmitRequest, TokenDelta
from actors.messages.handoff import HandoffOffer
from actors.messages.kv import KVAdmit, KVFree, KVGrow, KVReserve, KVStep, KVStepResult, KVTrim
from actors.messages.step import NewSequence, ScheduledSeq, SeqOutput, StepPlan, StepResult
from actors.scheduler.ballast import BallastPolicy, count_rows
from actors.scheduler.bursts import burst_length, burst_trims
from actors.scheduler.config import SchedulerConfig
from actors.scheduler.counters import Counters
from actors.scheduler.handoffs import HandoffTracker
from actors.scheduler.in_flight import InFlightStep
from actors.scheduler.latency import LatencyMeter
from actors.scheduler.requests import RequestTable
from actors.scheduler.sequence import Sequence, SeqStatus
from actors.scheduler.speculation import SpeculationPlanner

# What a client is told (TokenDelta.error): nothing of the cause, which goes to the engine's log.
SEQUENCE_FAILED = "internal error: the engine failed while generating this sequence"


class SeqFailure(NamedTuple):
    """A sequence the worker failed: the engine logs `detail` (a traceback) with the request id."""

    request_id: str
    index: int
    detail: str


@dataclass
class _Step:
    """The step under construction, between kv_transaction() and plan()."""

    grows: list[tuple[Sequence, int]] = field(default_factory=list)
    admits: list[Sequence] = field(default_factory=list)
    fork_children: list[Sequence] = field(default_factory=list)
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)    # seq id -> its block table, from the KV manager
    num_table_blocks: int = 0                                     # blocks in all tables after the transaction
    readers: dict[int, list[int]] = field(default_factory=dict)   # see InFlightStep
    burst: int = 0                                                # further decode steps the worker may run
    admit_budget: int = 0                                         # tokens the admits may take


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, spec: SpecController | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.cfg = cfg
        self.clock = clock
        self.waiting: list[Sequence] = []      # sorted by sort_key
        self.running: list[Sequence] = []      # sorted by sort_key: the last one is preempted first
        self.counters = Counters()
        self.lora_keys: dict[str, str] = {}    # adapter name -> name@contents, as the worker loaded it
        # Every request here and its sequences; what their ends send out.
        self.requests = RequestTable(cfg, self.counters, clock, self.lora_keys)
        # Speculative decoding (with a draft worker): k per decoding sequence, what the draft hears.
        self.speculation = SpeculationPlanner(spec, self.counters, cfg.max_model_len) if spec is not None else None
        # Disaggregation: prompts handed over to decode engines, and requests adopted from prefill ones.
        self.handoffs = HandoffTracker(cfg.block_size, self.requests)
        self.latency = LatencyMeter(self.counters, clock)   # first-token and inter-token latency
        self.ballast = BallastPolicy(cfg.ballast, self.latency)   # batch lines in the room left over
        self._step_id = 0
        self._step = _Step()
        self._in_flight = InFlightStep()
        self._trims: list[KVTrim] = []         # drafted or burst slots to roll back in the next transaction

    @property
    def seqs(self) -> dict[int, Sequence]:
        """The live sequences by id (the request table's)."""
        return self.requests.seqs

    # --- requests in and out ---------------------------------------------------------------------

    def add(self, msg: SubmitRequest) -> KVAdmit | None:
        """A new request waits to be admitted; one that cannot run ends at once (see RequestTable.add).
        Returns the admission it waits for, for the KV manager to read its tier blocks ahead."""
        leader = self.requests.add(msg)
        if leader is None:
            return None
        bisect.insort(self.waiting, leader, key=_key)
        return self._admit_msg(leader)

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """End a request (or one of its samples) now, as its client asked; its blocks go back at once."""
        return self._end(request_id, index, "abort")

    def fail_all(self, error: str) -> None:
        """The step failed for every sequence (or nothing fits the pool): every request ends with
        finish_reason "error" and `error` as its message, and frees its blocks, forgetting the KV
        the step was to write."""
        step = self._take_in_flight()
        self.requests.forget_unwritten(step.unwritten(step.starts))
        for request_id in list(self.requests):
            self._end(request_id, None, "error", error)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def take_deltas(self) -> dict[Any, list[TokenDelta]]:
        return self.requests.take_deltas()

    def take_frees(self) -> KVFree | None:
        return self.requests.take_frees()

    # --- disaggregation (the HandoffTracker): handing a prefilled request over, and taking one over

    def handoff_done(self, seq_id: int) -> None:
        """The handoff ended (sent, or cut: the front end continues the request elsewhere)."""
        self.requests.free(seq_id)

    def reserve_adoption(self, offer: HandoffOffer) -> KVReserve | None:
        return self.handoffs.reserve_adoption(offer)

    def adopt(self, seq_id: int, output_token_ids: list[int] | None = None) -> Sequence:
        """The reserved sequence's KV is in the cache (all but its last token's): it runs, decoding."""
        seq = self.handoffs.adopt(seq_id, output_token_ids)
        bisect.insort(self.running, seq, key=_key)
        return seq

    def drop_adoption(self, seq_id: int, reserved: bool = True) -> None:
        self.handoffs.drop_adoption(seq_id, reserved)

    # --- one step: KV transaction (the batch), plan, (forward), update ---------------------------

    def kv_transaction(self) -> KVStep:
        """Pick the next step's batch; the KV transaction that gives it blocks."""
        step = self._step = _Step()
        budget = self.cfg.max_num_batched_tokens
        # Running ballast gives its row, or its LoRA adapter's slot, to a waiting interactive request.
        displaced = self.ballast.displaced(self.running, self.waiting, self.cfg.max_num_seqs, self.cfg.max_loras,
                                           self.requests.fork_parents())
        for victim in displaced:
            self._preempt(victim)
        spec_k = self.speculation.choose(self.running) if self.speculation is not None else {}
        # Decodes first, then the chunks of prompts (or recomputes) already started, in priority and
        # arrival order: a prefill that sorts first (a more important request, a preempted older
        # one) must not take the budget from a stream that already emits tokens. Batch lines
        # (ballast) get what the interactive requests leave.
        interactive_tokens, ballast_room = 0, None   # ballast's room is set where its first turn comes
        for seq in self.ballast.budget_order(self.running, self.waiting):
            n = min(seq.num_tokens - seq.num_computed, budget)
            if seq.request.ballast:
                if ballast_room is None:
                    ballast_room = self.ballast.room(interactive_tokens)
                n = int(min(n, ballast_room))
                ballast_room -= max(n, 0)
            seq.spec_k = min(spec_k.get(seq.seq_id, 0), budget - n) if n > 0 else 0
            if n > 0:
                step.grows.append((seq, n))
                budget -= n + seq.spec_k
                interactive_tokens += 0 if seq.request.ballast else n + seq.spec_k
        others = self.speculation is not None or bool(self.waiting) or self.requests.forking()
        step.burst = burst_length(self.running, self.cfg.max_burst, self.cfg.max_model_len, others)
        room = self.cfg.max_num_seqs - len(self.running)
        admits = self._admissible(room) if budget > 0 and room > 0 else []
        if ballast_room is None:
            ballast_room = self.ballast.room(interactive_tokens)
        step.admits, step.admit_budget = self.ballast.admissions(admits, budget, ballast_room)
        forks, step.fork_children = self.requests.take_forks()
        frees = self.requests.take_deferred_frees() + [v.seq_id for v in displaced]
        trims, self._trims = self._trims, []
        return KVStep(frees, forks, [self._grow_msg(s, n) for s, n in step.grows],
                      [self._admit_msg(s) for s in step.admits], budget, trims)

    def apply_kv_result(self, res: KVStepResult) -> KVStep | None:
        """Apply a transaction's result; returns a retry transaction after a preemption, else None."""
        step = self._step
        for child, forked in zip(step.fork_children, res.forked):
            if not forked:  # no room to fork: the sample is computed from scratch (or from the prefix cache)
                self._requeue(child)
        step.fork_children = []
        for (seq, n), table in zip(step.grows, res.grown):
            if seq.status is not SeqStatus.RUNNING:
                continue  # requeued above; the transaction skipped it
            step.tables[seq.seq_id] = table
            step.scheduled.append((seq, n))
        step.num_table_blocks = res.num_table_blocks
        self.counters.prefix_cache_queried_tokens += res.queried_tokens
        self.counters.prefix_cache_hit_tokens += res.hit_tokens
        self.counters.prefix_cache_tier_hit_tokens += res.tier_hit_tokens
        if res.grow_failed:
            left = step.grows[len(res.grown):]
            if step.burst or any(s.spec_k for s, _ in left):
                # Drafting and bursts are optional: give up the lookahead slots before preempting anyone.
                for s, _ in left:
                    s.spec_k = 0
                step.burst = 0
                step.grows = left
                step.admits = []
                return KVStep([], [], [self._grow_msg(s, n) for s, n in left], [], 0)
            return self._preempt_and_retry(left)
        refused = step.admits[len(res.admitted):]
        for seq, adm in zip(step.admits, res.admitted):
            for writer in adm.reads_from:
                step.readers.setdefault(writer, []).append(seq.seq_id)
            self.waiting.remove(seq)
            step.tables[seq.seq_id] = adm.block_table
            seq.num_computed = adm.num_cached_tokens
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=_key)
            step.scheduled.append((seq, adm.num_new_tokens))
            if seq.index == 0 and not seq.known_to_worker:
                seq.request.num_cached_tokens = adm.num_cached_tokens
            if seq.request.queued_at is not None:
                self.counters.queue_time.observe(time.monotonic() - seq.request.queued_at)
                seq.request.queued_at = None
        step.admit_budget -= sum(adm.num_new_tokens for adm in res.admitted)
        return self._displace_ballast_for(refused)

    def plan(self) -> StepPlan:
        seqs, new, starts = [], [], {}
        tables = self._step.tables
        prefill_tokens, now = 0, self.clock()
        self.handoffs.planning()
        for seq, n in self._step.scheduled:
            start, end = seq.num_computed, seq.num_computed + n
            if start < seq.num_tokens - 1:   # not just the last sampled token: a prompt (or a recompute)
                prefill_tokens += n
            if seq.request.handoff_to is not None:
                self.handoffs.planned(seq, start, end)
            if seq.request.first_step_s is None:
                seq.request.first_step_s = now
            if not seq.known_to_worker:
                seq.known_to_worker = True
                new.append(NewSequence(seq.seq_id, seq.request.prompt_token_ids, seq.worker_params(), seq.seed,
                                       seq.output_token_ids, seq.request.lora_name))
            scheduled = ScheduledSeq(seq.seq_id, seq.token_ids[start:end], start, tables[seq.seq_id],
                                     end == seq.num_tokens)
            seqs.append(scheduled)
            if self.speculation is not None:
                self.speculation.scheduled(seq, scheduled)
            seq.num_computed = end
            starts[seq.seq_id] = start
        built, self._step = self._step, _Step()
        if not seqs:  # nothing runs: keep the releases for the next real step
            return StepPlan(self._step_id, [], [], [])
        self._step_id += 1
        self._in_flight = InFlightStep(starts, built.readers, self._step_id, built.burst > 0,
                                       None if prefill_tokens else len(seqs))
        self.counters.steps += 1
        self.counters.ballast_rows += count_rows(map(self.seqs.get, starts))
        self.counters.prefill_steps += prefill_tokens > 0
        self.counters.prefill_tokens += prefill_tokens
        self.counters.kv_slots_allocated += built.num_table_blocks * self.cfg.block_size
        self.counters.kv_slots_used += sum(s.num_computed for s in self.running)
        released = self.requests.take_released()
        if self.speculation is not None:
            self.speculation.planned(self._step_id, new)
        return StepPlan(self._step_id, seqs, new, released, built.burst)

    def update(self, result: StepResult) -> list[SeqFailure]:
        """Takes a step's tokens; returns the sequences the worker failed (each ended alone, with
        finish_reason "error"), and those that read their unwritten KV, for the caller to log."""
        step = self._take_in_flight()
        if step.decode_rows is not None:
            self.ballast.cost.observe(step.decode_rows, result.forward_s / max(result.num_steps, 1))
        self.counters.ballast_rows += (result.num_steps - 1) * count_rows(map(self.seqs.get, step.starts))
        failures = self._take_outputs(step, result.outputs)
        if step.burst:
            self._trims += burst_trims(map(self.seqs.get, step.starts), result.num_steps)
        self.handoffs.computed(self.seqs.get(seq_id) for seq_id in step.starts)
        self.counters.steps += result.num_steps - 1
        return failures

    def progress(self, step_id: int, outputs: list[SeqOutput]) -> list[SeqFailure]:
        """Tokens of a decode burst's step while the burst goes on (as `update`, the step stays in
        flight); nothing when that step is no longer the one in flight (it failed meanwhile)."""
        if step_id != self._in_flight.step_id or not self._in_flight.burst:
            return []
        return self._take_outputs(self._in_flight, outputs)

    def in_burst(self) -> bool:
        return self._in_flight.burst

    def _take_outputs(self, step: InFlightStep, outputs: list[SeqOutput]) -> list[SeqFailure]:
        failed = step.failed(outputs)
        self.requests.forget_unwritten(step.unwritten(failed))
        failures = [f for seq_id, detail in failed.items() if (f := self._fail(seq_id, detail)) is not None]
        eos, now = self.cfg.eos_token_ids, self.clock()
        for out in outputs:
            seq = self.seqs.get(out.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # failed, or aborted or preempted while the step ran
            kept, reason = seq.extend(out.token_ids, eos)
            self.counters.generation_tokens += kept
            self.latency.tokens(seq, kept, now)
            if seq.spec_k:
                self._trims += self.speculation.verified(seq, out.num_drafted, len(out.token_ids) - 1, reason is None)
            for child in self.requests.spawn_samples(seq):
                bisect.insort(self.running if child.status is SeqStatus.RUNNING else self.waiting, child, key=_key)
            if seq.index == 0 and seq.num_output_tokens == kept and kept:
                self.latency.first_token(seq.request, now)
            logprobs = out.logprobs[:kept] if out.logprobs is not None else None
            self.requests.delta(seq, out.token_ids[:kept], logprobs, reason, prompt_logprobs=out.prompt_logprobs,
                                embedding=out.embedding)
            if reason is not None:
                self._retire(seq)
            elif seq.request.handoff_to is not None:
                self._retire(seq, hand_over=True)
        return failures

    # --- internals --------------------------------------------------------------------------------

    def _admissible(self, room: int) -> list[Sequence]:
        """Up to `room` waiting sequences in queue order, skipping those whose LoRA adapter would make
        the running sequences read more adapters than the worker has slots: they wait for a slot."""
        if not self.cfg.max_loras:
            return self.waiting[:room]
        adapters = {s.request.lora_name for s in self.running} - {None}
        admits = []
        for seq in self.waiting:
            lora = seq.request.lora_name
            if lora is not None and lora not in adapters:
                if len(adapters) >= self.cfg.max_loras:
                    continue
                adapters.add(lora)
            admits.append(seq)
            if len(admits) == room:
                break
        return admits

    def _take_in_flight(self) -> InFlightStep:
        step, self._in_flight = self._in_flight, InFlightStep()
        return step

    def _fail(self, seq_id: int, detail: str) -> SeqFailure | None:
        seq = self.seqs.get(seq_id)
        if seq is None or seq.status is not SeqStatus.RUNNING:
            return None  # aborted while the step ran
        self._end(seq.request.request_id, seq.index, "error", SEQUENCE_FAILED)
        return SeqFailure(seq.request.request_id, seq.index, detail)

    def _grow_msg(self, seq: Sequence, n: int) -> KVGrow:
        return KVGrow(seq.seq_id, seq.token_ids, n, seq.spec_k + self._step.burst)

    def _admit_msg(self, seq: Sequence) -> KVAdmit:
        # Prompt logprobs need logits at every prompt position, an embedding hidden states: a cached
        # one has neither. Once the first token is out they have been sent, and a resumed sequence
        # reads the cache again.
        params = seq.request.params
        wants_logits = (params.prompt_logprobs is not None or params.embed) and seq.index == 0 \
            and seq.num_output_tokens == 0
        return KVAdmit(seq.seq_id, seq.token_ids, seq.request.cache_salt, not wants_logits)

    def _requeue(self, seq: Sequence) -> None:
        """Back to waiting with nothing computed: preemption, or a fork that found no room."""
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        self.handoffs.drop_ahead(seq)
        bisect.insort(self.waiting, seq, key=_key)

    def _displace_ballast_for(self, refused: list[Sequence]) -> KVStep | None:
        """An interactive request the pool had no blocks for (budget was left): the newest running
        ballast gives its blocks back and the admission is retried; None when none does."""
        step = self._step
        victim = self.ballast.block_victim(refused, self.running, step.admit_budget)
        if victim is None:
            return None
        self._preempt(victim)
        step.grows, step.fork_children, step.admits = [], [], [s for s in refused if not s.request.ballast]
        return KVStep([victim.seq_id], [], [], [self._admit_msg(s) for s in step.admits], step.admit_budget)

    def _preempt_and_retry(self, left: list[tuple[Sequence, int]]) -> KVStep:
        """The pool is out of blocks for left[0]: the least important, newest running sequence gives
        its blocks back and waits to be recomputed; then the grows that did not happen are retried."""
        victim = self.running[-1]
        self._preempt(victim)
        step = self._step
        step.grows = [(s, n) for s, n in left if s.status is SeqStatus.RUNNING]
        step.admits = []  # nothing new joins a step that had to preempt
        return KVStep([victim.seq_id], [], [self._grow_msg(s, n) for s, n in step.grows], [], 0)

    def _preempt(self, victim: Sequence) -> None:
        """The sequence gives its blocks back, leaves the step being built and waits to be recomputed."""
        self._requeue(victim)
        self.counters.preemptions += 1
        self._step.scheduled = [(s, n) for s, n in self._step.scheduled if s is not victim]

    def _retire(self, seq: Sequence, hand_over: bool = False) -> None:
        """Take a finished or aborted sequence out of the queues and the parts; its blocks go back to
        the pool, or, when it is handed over, once its KV has left (`handoff_done`)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        if seq.seq_id in self._in_flight.starts:
            # Aborted while the worker computes its step, which may yet fail: its blocks go back now,
            # without the hashes of those the step writes.
            self.requests.forget_unwritten(self._in_flight.unwritten([seq.seq_id]))
        if self.speculation is not None:
            self.speculation.forget(seq)
        if hand_over:
            self.handoffs.hand_over(seq)
        else:
            self.handoffs.drop_ahead(seq)
        self.requests.retire(seq, free=not hand_over)

    def _end(self, request_id: str, index: int | None, reason: str, error: str | None = None) -> bool:
        """End a request, or one of its samples, with `reason` (see RequestTable.end)."""
        ended = self.requests.end(request_id, index, reason, error)
        for seq in ended or []:
            self._retire(seq)
        return ended is not None


def _key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key

