"""The scheduler actor: admits requests, runs one step at a time, streams TokenDeltas back.

One step, in order (step() is piped to self, so Submit and Abort keep arriving during the forward):

    step()        schedule -> KV transaction -> draft -> forward      (mailbox held until the plan)
    _on_step()    update -> emit -> next step                          (in mailbox order)

It never polls: with no work it simply waits for the next message. A failed step ends its requests
with finish_reason "error", never "abort", and the engine goes on.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from actors.draft.controller import SpecController
from actors.draft.messages import Propose, Proposals
from actors.messages import (AbortRequest, EngineStats, GetKVStats, GetStats, StepPlan, StepResult, SubmitRequest,
                             TokenDeltas)
from actors.scheduler.scheduler import SchedulerConfig, Scheduler
from runtime import Actor, ActorDead, ActorRef, Pipe, Piped

NOTHING_FITS = "the request does not fit in the engine's KV cache"


class SchedulerActor(Actor):
    def __init__(self, cfg: SchedulerConfig, kv: ActorRef, worker: ActorRef, step_timeout_s: float = 600.0,
                 draft: ActorRef | None = None, spec: SpecController | None = None,
                 kv_bytes_per_token: float = 0.0):
        self.scheduler = Scheduler(cfg, spec if draft is not None else None)
        self.kv_bytes_per_token = kv_bytes_per_token   # reported in the stats
        self.spec = self.scheduler.spec
        self.kv = kv
        self.worker = worker
        self.draft = draft
        self.step_timeout_s = step_timeout_s
        self._step: Pipe | None = None   # the step in flight, until its outcome is handled
        self._started = 0.0
        self._interrupted = False   # a restart cancelled the step in flight: it never reports
        self.forward_s = self.compute_s = self.step_s = self.draft_s = 0.0

    async def on_start(self) -> None:
        """At the start, and after a restart (the same instance, its requests kept): the step the
        restart cancelled fails as a failed step does, so its requests end with "error" and the
        next step can start. A KV or worker failure here fails that next step, not this hook."""
        if self._interrupted:
            self._interrupted = False
            self._step_failed(RuntimeError("the scheduler restarted while its step ran"))
            self._send_outputs()
            await self._maybe_step()

    async def on_stop(self) -> None:
        """On a restart and at shutdown, after the runtime cancelled the step's pipe: nothing of
        that step comes back, not even an outcome already in the mailbox. Cannot fail."""
        self._interrupted, self._step = self._step is not None, None

    async def receive(self, msg: Any) -> Any:
        match msg:
            case SubmitRequest():
                try:
                    self.scheduler.add(msg)
                except ValueError as e:
                    self.context.log.warning("request refused", request_id=msg.request_id, error=str(e))
                self._send_outputs()
                await self._maybe_step()
            case AbortRequest(request_id=request_id, index=index):
                self.scheduler.abort(request_id, index)
                self._send_outputs()
            case Piped(result=outcome, error=error):
                await self._on_step(outcome, error)
            case GetStats():
                return await self._stats()
            case _:
                return await super().receive(msg)
        return None

    async def _maybe_step(self) -> None:
        """Start the next step, unless one is in flight or there is nothing to do. The mailbox waits
        until the step is planned: a Submit or an Abort must not land inside its KV transaction."""
        if self._step is not None or not self.scheduler.has_work():
            return
        self._started = time.perf_counter()
        planned = asyncio.get_running_loop().create_future()
        self._step = self.context.pipe_to_self(self.step(planned))
        await planned

    async def step(self, planned: asyncio.Future) -> tuple[StepPlan, StepResult] | None:
        """One step up to the worker's answer; its outcome comes back as a Piped message."""
        try:
            plan, propose = await self._schedule_kv()
        finally:
            planned.set_result(None)   # Submit and Abort flow again, during the draft and the forward
        if plan is None:
            return None
        await self._draft(plan, propose)
        return plan, await self._forward(plan)

    async def _on_step(self, outcome: tuple[StepPlan, StepResult] | None, error: BaseException | None) -> None:
        """The step's outcome, after every Abort that came during its forward: update -> emit -> next."""
        self._step = None
        if error is not None:
            self._step_failed(error)
            self.step_s += time.perf_counter() - self._started
        elif outcome is not None:
            self._update(*outcome)
        self._send_outputs()
        await self._maybe_step()

    async def _schedule_kv(self) -> tuple[StepPlan | None, Propose | None]:
        """The plan and the draft worker's message; a step that only preempted schedules again, and
        when still nothing fits, the queue fails (the plan is None)."""
        plan = await self._kv_transaction()
        if not plan.seqs:  # a step that only preempted: the next pass admits from the queue
            plan = await self._kv_transaction()
        if not plan.seqs:
            self.context.log.error("nothing fits in the KV pool; failing the queued requests")
            self.scheduler.fail_all(NOTHING_FITS)
            return None, None
        return plan, self.scheduler.take_propose()

    async def _kv_transaction(self) -> StepPlan:
        """One KV transaction per step; another only after a preemption."""
        kv_step = self.scheduler.schedule()
        while kv_step is not None:
            kv_step = self.scheduler.on_kv(await self.kv.ask(kv_step))
        return self.scheduler.plan()

    async def _draft(self, plan: StepPlan, propose: Propose | None) -> None:
        """The draft worker's tokens go into the plan; a step that drafts nothing only tells it the
        tokens (it keeps every sequence's history), without waiting."""
        if propose is None:
            return
        if not any(d.num_spec for d in propose.seqs):
            self.draft.tell(propose)
            return
        try:
            proposals: Proposals = await self.draft.ask(propose, timeout=self.step_timeout_s)
        except Exception as e:  # drafts only save time: the step goes on without them
            self.context.log.warning("draft worker failed; this step runs without drafts", error=repr(e))
            return
        by_id = {p.seq_id: p for p in proposals.proposals if p.token_ids}
        for seq in plan.seqs:
            p = by_id.get(seq.seq_id)
            if p is not None:
                seq.spec_token_ids, seq.spec_probs = p.token_ids, p.probs
        self.draft_s += proposals.draft_s

    async def _forward(self, plan: StepPlan) -> StepResult:
        """The worker computes the step; if it fails or times out, the step fails for all."""
        return await self.worker.ask(plan, timeout=self.step_timeout_s)

    def _step_failed(self, error: BaseException) -> None:
        """The step failed for all: every request ends with "error"; the next step starts afresh."""
        self.context.log.error("step failed", error=repr(error), exc_info=error)
        self.scheduler.fail_all(_step_error(error))

    def _update(self, plan: StepPlan, result: StepResult) -> None:
        """The step's tokens go into the sequences; its timings into the stats and, for a pure
        decode, into what the speculative controller knows drafting costs on this machine."""
        shape = _decode_shape(plan)
        for failed in self.scheduler.update(result):
            self.context.log.error("sequence failed", request_id=failed.request_id, index=failed.index,
                                   error=failed.detail)
        self.forward_s += result.forward_s
        self.compute_s += result.compute_s
        wall = time.perf_counter() - self._started
        self.step_s += wall
        if self.spec is not None and shape is not None:
            self.spec.observe_step(*shape, wall)

    def _send_outputs(self) -> None:
        """Blocks of finished sequences go back (once no step computes them); deltas go out, one
        message per front end."""
        frees = self.scheduler.take_frees()
        if frees is not None:
            self.kv.tell(frees)
        if self.draft is not None:
            released = self.scheduler.take_draft_released()
            if released:
                self.draft.tell(Propose(0, [], [], released))
        for reply_to, deltas in self.scheduler.take_deltas().items():
            reply_to.tell(TokenDeltas(deltas))

    async def _stats(self) -> EngineStats:
        kv = await self.kv.ask(GetKVStats())
        p, c = self.scheduler, self.scheduler.counters
        running = {s.request.request_id for s in p.running}
        return EngineStats(
            requests_running=len(running), requests_waiting=len(p.requests) - len(running),
            kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks,
            prefix_cache_queried_tokens=c.prefix_queried_tokens, prefix_cache_hit_tokens=c.prefix_hit_tokens,
            prompt_tokens=c.prompt_tokens, generation_tokens=c.generation_tokens, preemptions=c.preemptions,
            steps=c.steps, forward_s=self.forward_s, step_s=self.step_s,
            kv_slots_allocated=c.kv_slots_allocated, kv_slots_used=c.kv_slots_used,
            spec_decode_draft_tokens=c.spec_draft_tokens, spec_decode_accepted_tokens=c.spec_accepted_tokens,
            spec_decode_num_drafts=c.spec_num_drafts,
            spec_decode_mean_accepted_length=(c.spec_accepted_tokens + c.spec_num_drafts) / max(c.spec_num_drafts, 1),
            spec_decode_token_cost=self.spec.token_cost(1) if self.spec is not None else 0.0,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_token_capacity=kv.num_blocks * self.scheduler.cfg.block_size,
            queue_time_buckets=list(c.queue_time.counts), queue_time_sum=c.queue_time.sum)


def _step_error(error: BaseException) -> str:
    """What every request of a failed step is told; the cause itself goes to the log only."""
    if isinstance(error, TimeoutError):
        return "internal error: the engine step timed out"
    if isinstance(error, ActorDead):
        return "internal error: the model worker stopped"
    return "internal error: the engine step failed"


def _decode_shape(plan: StepPlan) -> tuple[int, int] | None:
    """(sequences, drafted tokens) when every sequence decodes one token plus its drafts, else None:
    a prefill chunk's cost would blur what the drafts cost."""
    if not plan.seqs or not all(s.sample and len(s.token_ids) == 1 for s in plan.seqs):
        return None
    return len(plan.seqs), sum(len(s.spec_token_ids) for s in plan.seqs)
