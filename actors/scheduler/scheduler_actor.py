"""The scheduler actor: admits requests, runs one step at a time, streams TokenDeltas back.

One step, in order, is `step()`: schedule -> KV transaction -> drafts -> forward -> update -> emit.
It runs in turns (runtime/turns.py): the mailbox waits while it plans, flows while the draft and
model workers compute (Submit and Abort keep arriving), and the update resumes in mailbox order.

A decode burst (actors/worker/decode_burst.py) is one step of several forwards: the step takes its
tokens as they arrive (StepProgress, in mailbox order among the Submits and Aborts) and emits them
at once; anything that should change the batch (a request in, an abort, a sequence done) pulls the
brake.

It never polls: with no work it simply waits for the next message. A failed step ends its requests
with finish_reason "error", never "abort", and the engine goes on.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import msgspec

from actors.draft.controller import SpecController
from actors.draft.messages import Propose, Proposals
from actors.messages.front_end import (
    AbortRequest, EngineStats, GetStats, ListLoRAAdapters, LoadLoRAAdapter, UnloadLoRAAdapter, SubmitRequest,
    TokenDeltas,
)
from actors.messages.handoff import (
    HandoffStart, HandoffRelease, HandoffReserve, HandoffSend, HandoffSendAhead, HandoffWithdraw, HandoffSent,
    HandoffSendLayers, HandoffDone, HandoffOffer, PrefixPullTimed,
)
from actors.messages.kv import GetKVStats, KVConfirm, KVReadAhead, KVReserved
from actors.messages.step import StepPlan, StepProgress, StepResult
from actors.scheduler.config import SchedulerConfig
from actors.scheduler.counters import HandoffCounters, stats_fields
from actors.scheduler.pull_cost import PullCost
from actors.scheduler.pulls import PullGate
from actors.scheduler.scheduler import Scheduler, SeqFailure
from actors.worker.decode_burst import BurstBrake
from actors.worker.tensor_parallel import RanksLost
from runtime import Actor, ActorDead, ActorRef, Turns

NOTHING_FITS = "the request does not fit in the engine's KV cache"


class SchedulerActor(Actor):
    def __init__(self, cfg: SchedulerConfig, kv: ActorRef, worker: ActorRef, step_timeout_s: float = 600.0,
                 draft: ActorRef | None = None, spec: SpecController | None = None, weight_bytes: int = 0,
                 kv_bytes_per_token: float = 0.0, brake: BurstBrake | None = None):
        self.scheduler = Scheduler(cfg, spec if draft is not None else None)
        self.kv_bytes_per_token = kv_bytes_per_token   # reported in the stats
        self.speculation = self.scheduler.speculation   # what the draft worker hears, and when
        self.spec = self.speculation.controller if self.speculation is not None else None
        self.kv = kv
        self.worker = worker
        self.draft = draft
        self.step_timeout_s = step_timeout_s
        self.brake = brake   # shared with the worker: ends a decode burst early
        self.weight_bytes = weight_bytes   # reported in the stats as the worker stated it
        self._steps: Turns | None = None   # steps run one after the other while there is work
        self._started = 0.0
        self._interrupted = False   # a restart cancelled the step in flight: it never reports
        self.forward_s = self.compute_s = self.step_s = self.draft_s = 0.0
        self.all_reduce_s = self.collective_s = 0.0   # tensor parallelism: rank 0's, from the StepResults
        # The KV transfer actor (a cluster node's, see actors/kv/transfer.py): without one, a request
        # that names a decode engine is served whole here.
        self.transfer: ActorRef | None = None
        self.block_layout = ""
        self.layer_stream = False   # prompts' blocks go layer by layer (the transfer reads the cache mid-forward)
        self.handoffs = HandoffCounters()
        self.pulls = PullGate()   # requests whose prefix the transfer actor pulls from a peer first
        # Nothing fit, but blocks reserved for handoffs in progress come back or start decoding
        # soon: no step until one of them ends.
        self._stalled = False
        self._lost = False   # the model worker is gone for good (a tensor-parallel rank died): no more steps

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
        """On a restart and at shutdown, after the runtime cancelled the steps: nothing of the step
        in flight comes back, not even an outcome already in the mailbox. Cannot fail."""
        self._interrupted = self._steps is not None and self._steps.away
        self._steps = None

    async def receive(self, msg: Any) -> Any:
        match msg:
            case SubmitRequest():
                if msg.handoff_to is not None and self.transfer is None:
                    msg = msgspec.structs.replace(msg, handoff_to=None)
                if self.pulls.hold(msg):
                    if msg.pull_from is not None:
                        self.transfer.tell(msg)
                    return None
                try:
                    admit = self.scheduler.add(msg)
                    if admit is not None and admit.read_prefix_cache:   # its tier blocks off disk while it waits
                        self.kv.tell(KVReadAhead(admit))
                except ValueError as e:
                    self.context.log.warning("request refused", request_id=msg.request_id, error=str(e))
                self._pull_brake()
                self._send_outputs()
                await self._maybe_step()
            case PrefixPullTimed(num_bytes=num_bytes, seconds=seconds, peer=peer):
                if self.pulls.cost is not None:
                    self.pulls.cost.pulled(num_bytes, seconds, peer)
            case AbortRequest(request_id=request_id, index=index):
                if index is None:
                    self.pulls.abort(request_id)
                self.scheduler.abort(request_id, index)
                self._pull_brake()
                self._send_outputs()
                await self._unstall()
            case StepProgress():
                pass   # a burst's tokens after its step ended (failed, or cancelled by a restart): too late
            case HandoffSent():
                self.handoffs.sent(msg)
                self.scheduler.handoff_done(msg.seq_id)
                self._send_outputs()
            case HandoffReserve(offer=offer):
                return await self._reserve(offer)
            case HandoffStart(seq_id=seq_id, output_token_ids=output_token_ids):
                self._pull_brake()
                await self._adopt(seq_id, output_token_ids)
            case HandoffRelease(seq_id=seq_id):
                self.scheduler.drop_adoption(seq_id)
                self._send_outputs()   # the reserved blocks go back before the next step asks for some
                await self._unstall()
            case GetStats():
                return await self._stats()
            case LoadLoRAAdapter() | UnloadLoRAAdapter() | ListLoRAAdapters():
                return await self._manage_lora(msg)
            case _:
                return await super().receive(msg)
        return None

    async def _maybe_step(self) -> None:
        """Start stepping, unless it goes on already, is stalled, or there is nothing to do. The steps
        start in this handler's turn: the mailbox waits for the plan (a Submit or an Abort must not land
        inside its KV transaction)."""
        if self._steps is not None or self._stalled or self._lost or not self.scheduler.has_work():
            return
        self._steps = self.context.run_in_turns(self._run_steps)
        await self._steps.first_turn()

    async def _run_steps(self, turn: Turns) -> None:
        """Step after step while there is work; each next step is planned in the turn the last emitted in."""
        while not self._stalled and not self._lost and self.scheduler.has_work():
            await self.step(turn)
        self._steps = None

    async def _unstall(self) -> None:
        if self._stalled:
            self._stalled = False
            await self._maybe_step()

    async def step(self, turn: Turns) -> None:
        """One step: schedule -> KV -> drafts -> forward -> update -> emit. No message is handled but
        while the draft and model workers compute; a decode burst's steps are taken and emitted as
        they come, and the update comes after every Abort sent meanwhile."""
        self._started = time.perf_counter()
        prefilled_before = self.scheduler.counters.prefill_tokens
        try:
            plan = await self._schedule_kv()
            if plan is None:   # nothing fits: stalled on handoffs, or the queue failed
                self._send_outputs()
                return
            result = await turn.reenter_after(self._draft_and_forward(plan), take=(StepProgress, self._burst_step))
        except RanksLost:
            # The worker stops the node (WorkerActor._ranks_lost): no request ends with an error here, so
            # a cluster sees the engine die and continues them on another.
            self._lost = True
            return
        except Exception as error:
            self._step_failed(error)
            self.step_s += time.perf_counter() - self._started
        else:
            self._update(plan, result)
            if self.pulls.cost is not None:   # what computing a prompt costs here, for the next pull's decision
                self.pulls.cost.prefilled(self.scheduler.counters.prefill_tokens - prefilled_before, result.forward_s)
        self._send_outputs()

    async def _schedule_kv(self) -> StepPlan | None:
        """The plan; a step that only preempted schedules again, and when still nothing fits, the queue
        waits for the handoffs holding blocks to end, or with none, fails (the plan is None)."""
        plan = await self._kv_transaction()
        if not plan.seqs:  # a step that only preempted: the next pass admits from the queue
            plan = await self._kv_transaction()
        if not plan.seqs and self.scheduler.handoffs.adopting():
            self._stalled = True
            return None
        if not plan.seqs:
            self.context.log.error("nothing fits in the KV pool; failing the queued requests")
            self.scheduler.fail_all(NOTHING_FITS)
            return None
        return plan

    async def _kv_transaction(self) -> StepPlan:
        """One KV transaction per step; another only after a preemption."""
        txn = self.scheduler.kv_transaction()
        while txn is not None:
            txn = self.scheduler.apply_kv_result(await self.kv.ask(txn))
        return self.scheduler.plan()

    async def _draft(self, plan: StepPlan) -> None:
        """The draft worker's tokens go into the plan; a step that drafts nothing only tells it the
        tokens (it keeps every sequence's history), without waiting."""
        propose = self.speculation.take_propose() if self.speculation is not None else None
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

    async def _draft_and_forward(self, plan: StepPlan) -> StepResult:
        await self._draft(plan)
        return await self._forward(plan)

    async def _forward(self, plan: StepPlan) -> StepResult:
        """The worker computes the step; if it fails or times out, the step fails for all."""
        self._stream_layers(plan)
        if plan.burst:   # no message was handled since the plan: a pull from now on ends the burst
            plan.report_to = self.context.self_ref
            if self.brake is not None:
                self.brake.release()
        return await self.worker.ask(plan, timeout=self.step_timeout_s)

    async def _burst_step(self, progress: StepProgress) -> None:
        """One of a decode burst's steps computed: its tokens go out now, and a sequence it ended
        pulls the brake (the batch changed)."""
        running = len(self.scheduler.running)
        self._log_failures(self.scheduler.progress(progress.step_id, progress.outputs))
        if len(self.scheduler.running) != running:
            self._pull_brake()
        self._send_outputs()

    def _pull_brake(self) -> None:
        if self.brake is not None and self.scheduler.in_burst():
            self.brake.pull()

    def _step_failed(self, error: BaseException) -> None:
        """The step failed for all: every request ends with "error"; the next step starts afresh."""
        self.context.log.error("step failed", error=repr(error), exc_info=error)
        self.scheduler.fail_all(_step_error(error))

    def _update(self, plan: StepPlan, result: StepResult) -> None:
        """The step's tokens go into the sequences; its timings into the stats and, for a pure
        decode, into what the speculative controller knows drafting costs on this machine."""
        shape = _decode_shape(plan)
        self._log_failures(self.scheduler.update(result))
        self._hand_over(plan)
        self.forward_s += result.forward_s
        self.compute_s += result.compute_s
        self.all_reduce_s += result.all_reduce_s
        self.collective_s += result.collective_s
        wall = time.perf_counter() - self._started
        self.step_s += wall
        if self.spec is not None and shape is not None:
            self.spec.observe_step(*shape, wall)

    def _log_failures(self, failures: list[SeqFailure]) -> None:
        for failed in failures:
            self.context.log.error("sequence failed", request_id=failed.request_id, index=failed.index,
                                   error=failed.detail)

    def _hand_over(self, plan: StepPlan) -> None:
        """Prefilled sequences go to their decode engines: the transfer actor sends their blocks.
        A prompt of several chunks sends the full blocks of each chunk ahead, while the next is computed."""
        self._cancel_ahead()
        ahead, handoffs = self.scheduler.handoffs.take_ready_ahead(), self.scheduler.handoffs.take_handoffs()
        if not (ahead or handoffs):
            return
        tables = {s.seq_id: s.block_table for s in plan.seqs}
        for seq, num_blocks in ahead:
            self.transfer.tell(HandoffSendAhead(seq.seq_id, tables[seq.seq_id], num_blocks, self._offer(seq),
                                             seq.request.handoff_to))
        for seq in handoffs:
            self.transfer.tell(HandoffSend(seq.seq_id, tables[seq.seq_id], self._offer(seq), seq.request.handoff_to))

    def _stream_layers(self, plan: StepPlan) -> None:
        """Prompts the step computes for decode engines go layer by layer: the transfer actor hears
        which blocks the step fills, and the worker tells it of each layer it has written."""
        if not self.layer_stream:
            return
        self._cancel_ahead()   # a preempted sequence's cancel goes before its recompute's blocks
        layered = self.scheduler.handoffs.take_layered()
        if not layered:   # most steps: nothing more on the way to the worker
            return
        tables = {s.seq_id: s.block_table for s in plan.seqs}
        for seq, first, end in layered:
            self.transfer.tell(HandoffSendLayers(seq.seq_id, plan.step_id, tables[seq.seq_id], first, end,
                                              self._offer(seq), seq.request.handoff_to))
        plan.layers_to = self.transfer

    def _cancel_ahead(self) -> None:
        """Sequences sent ahead and then preempted or ended: their decode engine lets the blocks go."""
        for seq_id in self.scheduler.handoffs.take_cancelled_ahead():
            self.transfer.tell(HandoffWithdraw(seq_id))

    def _offer(self, seq) -> HandoffOffer:
        req = seq.request
        return HandoffOffer(uuid.uuid4().hex, self.transfer, req.request_id, req.prompt_token_ids,
                       seq.output_token_ids, req.params, req.reply_to, req.priority, req.cache_salt,
                       req.num_cached_tokens, self.block_layout, req.ballast)

    async def _reserve(self, offer: HandoffOffer) -> KVReserved:
        """Blocks for a request another engine prefilled; a table of None when there is no room."""
        reserve = self.scheduler.reserve_adoption(offer)
        if reserve is None:
            return KVReserved(None)
        reserved: KVReserved = await self.kv.ask(reserve)
        if reserved.block_table is None:
            self.scheduler.drop_adoption(reserve.seq_id, reserved=False)
            self.handoffs.kv_handoffs_refused += 1
        return msgspec.structs.replace(reserved, seq_id=reserve.seq_id)

    async def _adopt(self, seq_id: int, output_token_ids: list[int] | None) -> None:
        """The handed-over KV is written: the sequence decodes from its first token on."""
        seq = self.scheduler.adopt(seq_id, output_token_ids)   # no step is planned before the confirmation is in
        await self.kv.ask(KVConfirm(seq_id, seq.num_computed))
        self.handoffs.kv_handoffs_received += 1
        seq.request.reply_to.tell(HandoffDone(seq.request.request_id))
        self._stalled = False
        await self._maybe_step()

    def _send_outputs(self) -> None:
        """Blocks of finished sequences go back (once no step computes them); deltas go out, one
        message per front end."""
        self._cancel_ahead()
        frees = self.scheduler.take_frees()
        if frees is not None:
            self.kv.tell(frees)
        if self.speculation is not None:
            released = self.speculation.take_released()
            if released:
                self.draft.tell(Propose(0, [], [], released))
        for reply_to, deltas in self.scheduler.take_deltas().items():
            reply_to.tell(TokenDeltas(deltas))

    async def _stats(self) -> EngineStats:
        kv = await self.kv.ask(GetKVStats())
        p, c = self.scheduler, self.scheduler.counters
        running = {s.request.request_id for s in p.running}
        ttft, itl = p.latency.recent_ttft.quantiles(0.5, 0.9), p.latency.recent_itl.quantiles(0.5, 0.9)
        return EngineStats(
            requests_running=len(running), requests_waiting=len(p.requests) - len(running),
            kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks,
            forward_s=self.forward_s, step_s=self.step_s, all_reduce_s=self.all_reduce_s,
            collective_s=self.collective_s,
            spec_decode_mean_accepted_length=(c.spec_decode_accepted_tokens + c.spec_decode_num_drafts)
            / max(c.spec_decode_num_drafts, 1),
            spec_decode_token_cost=self.spec.token_cost(1) if self.spec is not None else 0.0,
            weight_bytes=self.weight_bytes, kv_bytes_per_token=self.kv_bytes_per_token,
            kv_token_capacity=kv.num_blocks * self.scheduler.cfg.block_size,
            ttft_p50=ttft[0], ttft_p90=ttft[1], itl_p50=itl[0], itl_p90=itl[1],
            kv_tier=kv if kv.tier else None,
            max_loras=p.cfg.max_loras, lora_running=_per_adapter(p.running), lora_waiting=_per_adapter(p.waiting),
            lora_keys=dict(self.scheduler.lora_keys),
            **stats_fields(c), **stats_fields(self.handoffs), **_pull_rates(self.pulls.cost))

    async def _manage_lora(self, msg: LoadLoRAAdapter | UnloadLoRAAdapter | ListLoRAAdapters):
        """The worker holds the adapters; the scheduler keeps each one's identity (name@contents), which salts
        the prefix-cache hashes of the requests that name it."""
        outcome = await self.worker.ask(msg, timeout=self.step_timeout_s)
        if isinstance(msg, LoadLoRAAdapter) and not outcome.error:
            self.scheduler.lora_keys[msg.lora_name] = outcome.key
        elif isinstance(msg, UnloadLoRAAdapter) and not outcome.error:
            self.scheduler.lora_keys.pop(msg.lora_name, None)
        return outcome


def _per_adapter(seqs) -> dict[str, int]:
    """LoRA adapter -> requests among `seqs` (a request's samples counted once)."""
    requests = {s.request.request_id: s.request.lora_name for s in seqs if s.request.lora_name is not None}
    return dict(Counter(requests.values()))


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


def _pull_rates(cost: PullCost | None) -> dict[str, float]:
    """The pull-or-compute decision's measurements, for the stats (none without a transfer actor)."""
    if cost is None:
        return {}
    return {"prefix_pulls_skipped": cost.skipped, "prefill_tokens_per_s": cost.prefill.rate or 0.0,
            "pull_bytes_per_s": cost.link.rate or 0.0}
