"""What the scheduler knows about a request and each of its n samples (sequences).

Plain state and the stopping rule; no scheduling decisions here. A sequence's tokens are its
prompt followed by what it generated; after a preemption it recomputes all of them.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from actors.messages.front_end import SamplingParams
from prefix_store.hashing import adapter_salt


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class RequestState:
    """One SubmitRequest: shared by its n sequences."""

    __slots__ = ("request_id", "reply_to", "params", "priority", "arrival", "prompt_token_ids",
                 "cache_salt", "num_cached_tokens", "seqs", "max_output", "seed", "queued_at", "handoff_to",
                 "arrived_s", "first_step_s", "ballast", "lora_name")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 reply_to: Any, priority: int, arrival: int, cache_salt: str | None, max_model_len: int,
                 ballast: bool = False, lora_name: str | None = None, lora_key: str | None = None):
        self.request_id = request_id
        self.reply_to = reply_to
        self.params = params
        self.priority = priority
        self.arrival = arrival
        self.prompt_token_ids = prompt_token_ids
        self.lora_name = lora_name
        self.cache_salt = adapter_salt(cache_salt, lora_name, lora_key)
        self.num_cached_tokens = 0
        self.seqs: list[Sequence] = []
        # The context length caps every request's output, whatever max_tokens says.
        room = max_model_len - len(prompt_token_ids)
        self.max_output = room if params.max_tokens is None else min(params.max_tokens, room)
        self.seed = params.seed
        self.queued_at: float | None = time.monotonic()   # None once first scheduled
        self.handoff_to: Any = None           # a decode engine's KV receiver (prefill engines)
        self.arrived_s = 0.0                  # when it reached the scheduler, and when it first ran
        self.first_step_s: float | None = None
        self.ballast = ballast                # a batch line: below every interactive request (ballast.py)


class Sequence:
    __slots__ = ("seq_id", "request", "index", "token_ids", "num_prompt_tokens", "num_computed",
                 "status", "known_to_worker", "sort_key", "spec_k", "last_token_s")

    def __init__(self, seq_id: int, request: RequestState, index: int):
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed = 0             # tokens whose KV is in the cache (or being written this step)
        self.status = SeqStatus.WAITING
        self.known_to_worker = False      # the worker holds its sampler state
        # Lower sorts first: interactive before ballast, the most important, then the oldest request,
        # then sample order.
        self.sort_key = (request.ballast, request.priority, request.arrival, index)
        self.spec_k = 0                   # tokens to draft in the step being planned (lookahead slots)
        self.last_token_s: float | None = None   # when this engine last emitted its tokens (inter-token latency)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def room(self, max_model_len: int) -> int:
        """Tokens it may still generate: never past its output's length nor the context."""
        return min(self.request.max_output - self.num_output_tokens, max_model_len - self.num_tokens + 1)

    @property
    def seed(self) -> int | None:
        seed = self.request.seed
        return None if seed is None else seed + self.index

    def append(self, token_id: int, eos_token_ids: frozenset[int]) -> str | None:
        """Add one generated token; returns the finish reason when it ends the sequence."""
        self.token_ids.append(token_id)
        params = self.request.params
        if self.num_output_tokens < params.min_tokens:   # as vLLM: only the length ends it before
            return "length" if self.num_output_tokens >= self.request.max_output else None
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= self.request.max_output:
            return "length"
        return None

    def extend(self, token_ids: list[int], eos_token_ids: frozenset[int]) -> tuple[int, str | None]:
        """Add a step's tokens up to the first that ends the sequence: how many it kept, and the
        finish reason (None: it goes on)."""
        kept, reason = 0, None
        for token_id in token_ids:
            kept += 1
            reason = self.append(token_id, eos_token_ids)
            if reason is not None:
                break
        return kept, reason

    def worker_params(self) -> SamplingParams:
        """The sampler's params for this sequence: the prompt's logprobs are sample 0's alone (the
        others fork after the prompt and compute only its last block)."""
        params = self.request.params
        if self.index > 0 and params.prompt_logprobs is not None:
            return msgspec.structs.replace(params, prompt_logprobs=None)
        return params

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id}#{self.index}, id={self.seq_id}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed})")
