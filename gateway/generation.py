"""One HTTP request's generation: its prompts' engine requests, their text, usage and metrics.

Turns TokenDeltas into per-choice text deltas (incremental detokenization, stop strings), aborts
engine requests that are no longer wanted (stop string, disconnect), and never touches HTTP. A
sample the engine failed ends the whole request with RequestFailed, never a normal-looking finish.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from actors.messages.front_end import SamplingParams, TokenDelta, TokenLogprobs
from actors.text.sample_output import SampleOutput
from gateway.engine_client import EngineLost, RequestFailed
from gateway.engine_connection import EngineConnection
from gateway.metrics import GatewayMetrics


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    # On each choice's first delta when the request asked for them: its prompt's logprobs.
    prompt_logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None   # an embedding request's pooled prompt
    # On the delta that finishes a choice by a stop string: the string (Anthropic's stop_sequence).
    stop_string: str | None = None


class _Choice:
    __slots__ = ("out", "last_t", "started", "abort_pending", "prompt_sent")

    def __init__(self, out: SampleOutput) -> None:
        self.out = out
        self.last_t = 0.0
        self.started = False        # the engine has sent this sample something
        self.abort_pending = False  # stopped by a stop string; abort once every sample started
        self.prompt_sent = False    # its prompt logprobs went out with a delta


class _Sub:
    """One prompt's engine request (n samples)."""

    __slots__ = ("request_id", "first", "choices", "num_prompt_tokens", "num_cached_tokens",
                 "prompt_logprobs")

    def __init__(self, request_id: str, first: int, choices: list[_Choice], num_prompt: int) -> None:
        self.request_id = request_id
        self.first = first
        self.choices = choices
        self.num_prompt_tokens = num_prompt
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprobs] | None = None   # from sample 0, for every sample


class Generation:
    def __init__(self, client: EngineConnection, tokenizer, request_id: str,
                 prompts: list[list[int]], params: SamplingParams, stop: list[str],
                 priority: int, metrics: GatewayMetrics, arrival: float,
                 cache_salt: str | None = None, ballast: bool = False, lora_name: str | None = None) -> None:
        """`cache_salt`: the request's own prefix-cache salt (vLLM's), on top of its tenant's;
        `ballast`: a batch line, which the engine runs only in room interactive requests leave;
        `lora_name`: the LoRA adapter it generates with."""
        self.request_id = request_id
        self.ballast = ballast
        self._cache_salt = cache_salt
        self._lora_name = lora_name
        self._client = client
        self._params = params
        self._priority = priority
        self._metrics = metrics
        self._arrival = arrival
        self._queue: asyncio.Queue = asyncio.Queue()
        self._subs: dict[str, _Sub] = {}
        for p, ids in enumerate(prompts):
            choices = [_Choice(SampleOutput(tokenizer, ids, stop, params.skip_special_tokens,
                                            params.include_stop_str_in_output)) for _ in range(params.n)]
            rid = request_id if len(prompts) == 1 else f"{request_id}-{p}"
            self._subs[rid] = _Sub(rid, p * params.n, choices, len(ids))
        self._prompts = prompts
        self._open = len(self._subs) * params.n
        self._first_token_at: float | None = None
        self.num_waiting = 0   # samples submitted with nothing back yet: the gateway's queue limit

    @property
    def done(self) -> bool:
        return self._open == 0

    def start(self) -> None:
        self._metrics.queue.observe(time.monotonic() - self._arrival)
        for sub, ids in zip(self._subs.values(), self._prompts):
            self._client.submit(sub.request_id, ids, self._params, self._queue, self._priority,
                                request_salt=self._cache_salt, ballast=self.ballast, lora_name=self._lora_name)
        self.num_waiting = len(self._subs) * self._params.n

    async def next(self, timeout: float | None = None) -> list[ChoiceDelta] | None:
        """The next text deltas, or None when `timeout` passed first. Raises EngineLost or
        RequestFailed."""
        if timeout is None:
            item = await self._queue.get()
        else:
            try:
                async with asyncio.timeout(timeout):
                    item = await self._queue.get()
            except TimeoutError:
                return None
        items = [item]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        out: list[ChoiceDelta] = []
        now = time.monotonic()
        for it in items:
            if isinstance(it, (EngineLost, RequestFailed)):
                raise it
            cd = self._apply(it, now)
            if cd is not None:
                out.append(cd)
        return out

    def _apply(self, d: TokenDelta, now: float) -> ChoiceDelta | None:
        sub = self._subs.get(d.request_id)
        if sub is None or d.index >= len(sub.choices):
            return None
        ch = sub.choices[d.index]
        if not ch.started:
            ch.started = True
            self.num_waiting -= 1
        if not ch.out.finished and d.finish_reason in ("error", "abort"):
            # Failed by the engine, or aborted without this request asking (its own aborts come
            # after the sample finished here): either way the client hears of an error.
            ch.out.end("error", d.error, engine_done=True)
            self._open -= 1
            self._metrics.finished("error")
            raise RequestFailed(d.error or "The engine ended this request before it finished.")
        if ch.out.finished:
            ch.out.push(d)   # notes whether the engine is done with it
            self._send_pending_aborts(sub)
            return None
        m = self._metrics
        if self._first_token_at is None:
            self._first_token_at = now
            m.ttft.observe(now - self._arrival)
        elif ch.last_t and d.token_ids:   # per token: a delta may carry several (speculative decoding)
            m.itl.observe((now - ch.last_t) / len(d.token_ids), len(d.token_ids))
        if d.token_ids:
            ch.last_t = now
        sub.num_prompt_tokens = d.num_prompt_tokens or sub.num_prompt_tokens
        sub.num_cached_tokens = max(sub.num_cached_tokens, d.num_cached_tokens)
        if d.prompt_logprobs is not None:
            sub.prompt_logprobs = d.prompt_logprobs
        prompt_lps = None
        if sub.prompt_logprobs is not None and not ch.prompt_sent:
            ch.prompt_sent, prompt_lps = True, sub.prompt_logprobs
        text = ch.out.push(d)
        if ch.out.finished:
            self._open -= 1
            m.finished(ch.out.finish_reason)
            ch.abort_pending = ch.out.stopped_here   # a stop string matched: this sample need not go on
        self._send_pending_aborts(sub)
        return ChoiceDelta(sub.first + d.index, text, d.token_ids, d.logprobs, ch.out.finish_reason, prompt_lps,
                           d.embedding, ch.out.stop_string)

    def _send_pending_aborts(self, sub: _Sub) -> None:
        # The engine forks samples 1..n-1 from sample 0 after the prompt; aborting sample 0
        # before they exist would end them all, so a single-sample abort waits until all started.
        if len(sub.choices) == 1:
            if sub.choices[0].abort_pending:
                sub.choices[0].abort_pending = False
                self._client.abort(sub.request_id)
            return
        if not all(c.started for c in sub.choices):
            return
        for i, c in enumerate(sub.choices):
            if c.abort_pending:
                c.abort_pending = False
                if not c.out.engine_done:
                    self._client.abort(sub.request_id, i)

    def close(self) -> None:
        """Always called: aborts what the engine still runs (client gone, error) and unroutes."""
        for sub in self._subs.values():
            if not all(c.out.engine_done for c in sub.choices):
                self._client.abort(sub.request_id)
                for c in sub.choices:
                    if not c.out.finished:
                        self._metrics.finished("abort")
            self._client.release(sub.request_id)
        self.num_waiting = 0
        if self._open == 0:
            self._metrics.e2e.observe(time.monotonic() - self._arrival)

    def usage(self, index: int | None = None) -> dict:
        """The whole request's usage so far, or (`index`) one choice's: its prompt and its tokens,
        as vLLM's continuous usage stats count them."""
        subs = list(self._subs.values())
        if index is not None:
            sub = next(s for s in subs if s.first <= index < s.first + len(s.choices))
            prompt, cached = sub.num_prompt_tokens, sub.num_cached_tokens
            completion = len(sub.choices[index - sub.first].out.token_ids)
        else:
            prompt = sum(s.num_prompt_tokens for s in subs)
            completion = sum(len(c.out.token_ids) for s in subs for c in s.choices)
            cached = sum(s.num_cached_tokens for s in subs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}
