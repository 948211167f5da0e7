"""The requests in the engine, their sequences (one per sample), and what their ends send out.

A request's life apart from its scheduling: it comes in (`add`, or adopted from a prefill engine
through the HandoffTracker), its other samples fork from its prompt (`spawn_samples`), its sequences
end (`end`, `retire`), and each end queues what goes out: the TokenDelta for its front end, its
blocks for the KV manager, its sampler state for the worker. A plain synchronous class the scheduler
owns; it never touches the queues (waiting, running): the scheduler moves sequences between them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

from actors.messages.front_end import SamplingParams, SubmitRequest, TokenDelta
from actors.messages.handoff import HandoffOffer
from actors.messages.kv import KVFork, KVFree, KVUnwritten
from actors.scheduler.config import SchedulerConfig
from actors.scheduler.counters import Counters
from actors.scheduler.sequence import RequestState, Sequence, SeqStatus

# What a client is told (TokenDelta.error) of a prompt the front end should have refused.
EMPTY_PROMPT = "the prompt is empty"


class RequestTable(Mapping[str, RequestState]):
    """Request id -> RequestState, for each request with a sequence still to end; `seqs` holds the
    live sequences by id."""

    def __init__(self, cfg: SchedulerConfig, counters: Counters, clock: Callable[[], float],
                 lora_keys: dict[str, str]):
        self.cfg = cfg
        self.counters = counters
        self.clock = clock
        self.lora_keys = lora_keys             # adapter name -> name@contents (the scheduler actor keeps it)
        self.seqs: dict[int, Sequence] = {}
        self._requests: dict[str, RequestState] = {}
        self._next_seq_id = 0
        self._arrivals = 0
        self._forks: list[tuple[KVFork, Sequence]] = []   # for the next transaction
        self._deferred_frees: list[int] = []   # a fork parent's free must follow its forks
        self._frees: list[int] = []            # sequences whose blocks return to the pool now
        self._unwritten: list[KVUnwritten] = []   # failed sequences' KV to forget before their free
        self._released: list[int] = []         # sequences whose sampler state the worker drops
        self._outbox: dict[Any, list[TokenDelta]] = defaultdict(list)

    def __getitem__(self, request_id: str) -> RequestState:
        return self._requests[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    # --- requests in -----------------------------------------------------------------------------

    def add(self, msg: SubmitRequest) -> Sequence | None:
        """A submitted request's first sequence, to queue; None when the request ended at once (an
        empty prompt, no room left in the context), its delta queued. A request id in use is a ValueError."""
        if msg.request_id in self._requests:
            raise ValueError(f"request id {msg.request_id!r} is already in the engine")
        params = msg.params
        if params.min_tokens and not params.ignore_eos:  # the sampler masks what would stop it early
            params = msgspec.structs.replace(params, eos_token_ids=sorted(self.cfg.eos_token_ids))
        req = self._open(msg.request_id, msg.prompt_token_ids, params, msg.reply_to, msg.priority,
                         msg.cache_salt, msg.ballast, msg.lora_name)
        req.arrived_s = self.clock()
        if msg.lora_name is not None:
            self.counters.lora_requests[msg.lora_name] += 1
        # n > 1 samples fork from one prompt here, and prompt logprobs come with the prompt's own
        # forward: such a request stays whole (and so does one with an adapter: a handoff carries none).
        if params.n == 1 and params.prompt_logprobs is None and not params.embed and msg.lora_name is None:
            req.handoff_to = msg.handoff_to
        if not msg.prompt_token_ids:  # bad input the front end should have refused
            self._end_unstarted(req, "error", EMPTY_PROMPT)
            return None
        if req.max_output < 1:  # no room left in the context: nothing can be generated
            self._end_unstarted(req, "length")
            return None
        leader = self._new_seq(req, 0)
        self.enter(leader)
        return leader

    def offered(self, offer: HandoffOffer) -> Sequence:
        """The sequence of a request another engine prefilled; not in the table until it `enter`s."""
        req = self._open(offer.request_id, offer.prompt_token_ids, offer.params, offer.reply_to, offer.priority,
                         offer.cache_salt, offer.ballast)
        req.num_cached_tokens = offer.num_cached_tokens
        return self._new_seq(req, 0)

    def enter(self, seq: Sequence) -> None:
        """A request's first sequence, and the request with it, join the table."""
        self._requests[seq.request.request_id] = seq.request
        self.seqs[seq.seq_id] = seq
        self.counters.prompt_tokens += seq.num_prompt_tokens

    # --- samples: n > 1 fork from sample 0 once its prompt is computed --------------------------

    def spawn_samples(self, leader: Sequence) -> list[Sequence]:
        """After sample 0's first token, once: the other samples, sharing its prompt's full blocks
        (running, each with a fork for the next transaction) and recomputing only the partial last
        block to draw their own first token. A prompt within one block has no full block to share:
        its samples wait to be admitted like new requests."""
        req, bs = leader.request, self.cfg.block_size
        if leader.index != 0 or len(req.seqs) >= req.params.n:
            return []
        shared = (leader.num_prompt_tokens - 1) // bs * bs
        children = []
        for index in range(1, req.params.n):
            child = self._new_seq(req, index)
            self.seqs[child.seq_id] = child
            if shared:
                child.status = SeqStatus.RUNNING
                child.num_computed = shared
                self._forks.append((KVFork(leader.seq_id, child.seq_id, shared), child))
            children.append(child)
        return children

    def take_forks(self) -> tuple[list[KVFork], list[Sequence]]:
        """The forks for the next transaction, and their children in the same order."""
        forks, self._forks = self._forks, []
        return [f for f, _ in forks], [c for _, c in forks]

    def forking(self) -> bool:
        return bool(self._forks)

    def fork_parents(self) -> set[int]:
        """Sequences with a fork pending: their blocks stay until the forks are made."""
        return {f.parent_seq_id for f, _ in self._forks}

    # --- requests out ----------------------------------------------------------------------------

    def end(self, request_id: str, index: int | None, reason: str, error: str | None = None) -> list[Sequence] | None:
        """End a request (index None), or one of its samples, with `reason`: each of its sequences still
        live, for the scheduler to take out of its queues and `retire`, its delta queued. None when the
        request is not here or that sample has not started yet (it forks from sample 0 after the prompt).
        Sample 0 before the others started ends them all: they would have forked from it."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if index is not None and index > 0 and len(req.seqs) < req.params.n:
            return None
        if index is None or (index == 0 and len(req.seqs) < req.params.n):
            self._requests.pop(request_id)  # whole request: no sample will be spawned any more
            targets = req.seqs
        else:
            targets = [s for s in req.seqs if s.index == index]
        ids = {s.seq_id for s in targets}
        # A pending fork of an ended child is dropped; one from an ended parent still happens
        # (the parent's free waits for it), so its live children keep their shared blocks.
        self._forks = [(f, c) for f, c in self._forks if f.child_seq_id not in ids]
        live = [s for s in targets if s.status is not SeqStatus.FINISHED]
        for seq in live:
            self.delta(seq, [], None, reason, error)
        if targets is req.seqs:
            self._end_unstarted(req, reason, error)
        return live

    def retire(self, seq: Sequence, free: bool = True) -> None:
        """The sequence is out of the queues, finished: its blocks go back (a fork parent's once its
        forks are made; not at all without `free`: a handoff's, once its KV has left), its sampler
        state is dropped, and its request leaves with its last sequence."""
        seq.status = SeqStatus.FINISHED
        self.seqs.pop(seq.seq_id, None)
        if free:
            if any(f.parent_seq_id == seq.seq_id for f, _ in self._forks):
                self._deferred_frees.append(seq.seq_id)
            else:
                self._frees.append(seq.seq_id)
        if seq.known_to_worker:
            self._released.append(seq.seq_id)
        req = seq.request
        if len(req.seqs) == req.params.n and all(s.status is SeqStatus.FINISHED for s in req.seqs):
            self._requests.pop(req.request_id, None)
            self.counters.ballast_finished += req.ballast

    def free(self, seq_id: int) -> None:
        """A sequence out of the table whose blocks go back now (a handoff ended, an adoption was cut)."""
        self._frees.append(seq_id)

    def forget_unwritten(self, unwritten: list[KVUnwritten]) -> None:
        """KV a failed (or aborted) step was to write: forgotten before the sequences' blocks are freed."""
        self._unwritten += unwritten

    def delta(self, seq: Sequence, token_ids: list[int], logprobs: list | None, reason: str | None,
              error: str | None = None, prompt_logprobs: list | None = None,
              embedding: list[float] | None = None) -> None:
        """What the sequence's front end hears of it."""
        req = seq.request
        self._outbox[req.reply_to].append(TokenDelta(req.request_id, seq.index, list(token_ids), logprobs,
                                                     reason, len(req.prompt_token_ids), req.num_cached_tokens,
                                                     error, prompt_logprobs, embedding))

    # --- what goes out: taken by the scheduler (the KV transaction, the plan) and its actor -------

    def take_deltas(self) -> dict[Any, list[TokenDelta]]:
        out, self._outbox = self._outbox, defaultdict(list)
        return out

    def take_frees(self) -> KVFree | None:
        """Blocks of ended sequences to give back, failed ones with the KV their step never wrote."""
        if not (self._frees or self._unwritten):
            return None
        msg = KVFree(self._frees, self._unwritten)
        self._frees, self._unwritten = [], []
        return msg

    def take_deferred_frees(self) -> list[int]:
        """Ended fork parents, freed in the transaction that makes their forks (after them)."""
        out, self._deferred_frees = self._deferred_frees, []
        return out

    def take_released(self) -> list[int]:
        """Ended sequences whose sampler state the worker drops, with the next plan."""
        out, self._released = self._released, []
        return out

    # --- internals --------------------------------------------------------------------------------

    def _open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, reply_to: Any,
              priority: int, cache_salt: str | None, ballast: bool = False,
              lora_name: str | None = None) -> RequestState:
        self._arrivals += 1
        priority = priority if self.cfg.priority_scheduling else 0
        return RequestState(request_id, list(prompt_token_ids), params, reply_to, priority, self._arrivals,
                            cache_salt, self.cfg.max_model_len, ballast, lora_name, self.lora_keys.get(lora_name))

    def _new_seq(self, req: RequestState, index: int) -> Sequence:
        seq = Sequence(self._next_seq_id, req, index)
        self._next_seq_id += 1
        req.seqs.append(seq)
        return seq

    def _end_unstarted(self, req: RequestState, reason: str, error: str | None = None) -> None:
        """Samples that never started still get their (only) delta."""
        for index in range(len(req.seqs), req.params.n):
            self._outbox[req.reply_to].append(TokenDelta(req.request_id, index, [], None, reason,
                                                         len(req.prompt_token_ids), req.num_cached_tokens, error))
