"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM.

It runs a real engine (scheduler, KV manager, worker actors) on an event loop in a background
thread and is itself one more actor there, receiving TokenDeltas; it never calls the model directly.
Stop strings are matched here, after incremental detokenization, and end their sample by abort.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from actors.config import EngineConfig
from actors.text.sample_output import SampleOutput
from actors.engine import Engine, start_engine
from actors.messages.front_end import (
    AbortRequest, EngineStats, GetStats, LoadLoRAAdapter, LoRAOutcome, SamplingParams, SubmitRequest,
    TokenDeltas, UnloadLoRAAdapter,
)
from runtime import Actor
from runtime.loop import new_event_loop


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None                       # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None            # the stop string or stop token that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: the sampled token's and the top-k logprobs
    cumulative_logprob: float | None = None
    error: str | None = None                        # with finish_reason "error": what went wrong


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per token its
    # logprob and the top k (token id -> logprob), as vLLM's.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None   # with SamplingParams(embed=True): the pooled prompt


@dataclass
class _Pending:
    """One request being collected; resolves `done` when every sample has finished."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    done: asyncio.Future
    samples: list[SampleOutput]
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None


class _Collector(Actor):
    """Receives the engine's TokenDeltas for the LLM's requests."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.pending: dict[str, _Pending] = {}

    async def on_stop(self) -> None:
        """The engine's system stopped (a tensor-parallel rank lost stops it): what is still running ends
        with "error" rather than waiting forever."""
        for p in self.pending.values():
            for sample in p.samples:
                sample.end("error", "the engine stopped while generating this sequence")
            if not p.done.done():
                p.done.set_result(p)
        self.pending.clear()

    async def receive(self, msg: Any) -> Any:
        if not isinstance(msg, TokenDeltas):
            return await super().receive(msg)
        for d in msg.deltas:
            p = self.pending.get(d.request_id)
            if p is None or p.samples[d.index].finished:
                continue  # a sample already ended by its stop string
            p.num_cached_tokens = d.num_cached_tokens
            if d.embedding is not None:
                p.embedding = d.embedding
            if d.prompt_logprobs is not None:
                p.prompt_logprobs = [None] + [{lp.token_id: lp.logprob, **dict(lp.top)} for lp in d.prompt_logprobs]
            if d.logprobs is not None:
                p.logprobs[d.index].extend({lp.token_id: lp.logprob, **dict(lp.top)} for lp in d.logprobs)
            sample = p.samples[d.index]
            sample.push(d)
            if sample.stopped_here:
                self.engine.scheduler.tell(AbortRequest(d.request_id, d.index))
            if all(s.finished for s in p.samples):
                del self.pending[d.request_id]
                p.done.set_result(p)
        return None


class LLM:
    def __init__(self, model: str | None = None, **engine_config: Any):
        self.config = EngineConfig(model=model, **engine_config)
        self._loop = new_event_loop()   # uvloop where installed, as `matinee serve` runs on
        self._thread = threading.Thread(target=self._loop.run_forever, name="matinee-llm", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        try:
            self.engine: Engine = self._call(start_engine(self.config, name="llm"))
            self._collector = _Collector(self.engine)
            self._collector_ref = self._call(self.engine.system.spawn(self._collector, name="llm-front"))
        except BaseException:
            self._stop_loop()
            raise
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts: a string, a list of token ids, or a list
        of either (or dicts with "prompt" / "prompt_token_ids").

        A sample the engine failed (as vLLM's FinishReason.ERROR) does not raise: its output has
        finish_reason "error", the tokens made before the failure and the message in `error`; the
        other prompts' outputs are unaffected. An empty prompt ends the same way.

        `use_tqdm` draws a bar on stderr over the prompts as they finish, as vLLM's does. `lora_request`
        names the LoRA adapter (loaded with --lora-modules or `load_lora`) for every prompt, or one per
        prompt (None: the base model)."""
        items = [self._tokenize(p) for p in _as_prompt_list(prompts)]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(items)
        if len(loras) != len(items):
            raise ValueError(f"{len(loras)} LoRA requests for {len(items)} prompts")
        return self._call(self._generate(items, params, use_tqdm, loras))

    def load_lora(self, name: str, path: str) -> None:
        """Reads the PEFT folder `path` as adapter `name`; ValueError naming what is wrong with it."""
        outcome: LoRAOutcome = self._call(self.engine.scheduler.ask(LoadLoRAAdapter(name, path)))
        if outcome.error:
            raise ValueError(outcome.error)

    def unload_lora(self, name: str) -> None:
        outcome: LoRAOutcome = self._call(self.engine.scheduler.ask(UnloadLoRAAdapter(name)))
        if outcome.error:
            raise ValueError(outcome.error)

    def embed(self, prompts: Any) -> list[list[float]]:
        """Each prompt's embedding, pooled as the model pools (actors/worker/pooling.py), in order."""
        outs = self.generate(prompts, SamplingParams(max_tokens=1, temperature=0, embed=True))
        failed = [o.outputs[0].error for o in outs if o.embedding is None]
        if failed:
            raise RuntimeError(f"an embedding failed: {failed[0]}")
        return [o.embedding for o in outs]

    def stats(self) -> EngineStats:
        return self._call(self.engine.scheduler.ask(GetStats()))

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.engine.stop())
        finally:
            self._stop_loop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- on the engine's loop --------------------------------------------------------------------

    async def _generate(self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams],
                        use_tqdm: bool, loras: list[str | None]) -> list[RequestOutput]:
        loop = asyncio.get_running_loop()
        ids, futures = [], []
        for (text, token_ids), sp, lora in zip(items, params, loras):
            rid = f"llm-{next(self._ids)}"
            n = sp.n
            samples = [SampleOutput(self.tokenizer, token_ids, sp.stop, sp.skip_special_tokens,
                                    sp.include_stop_str_in_output, sp.stop_token_ids, streamed=False)
                       for _ in range(n)]
            pending = _Pending(text, token_ids, sp, loop.create_future(), samples,
                               [[] if sp.logprobs is not None else None for _ in range(n)])
            self._collector.pending[rid] = pending
            ids.append(rid)
            futures.append(pending.done)
            self.engine.scheduler.tell(SubmitRequest(rid, token_ids, sp, self._collector_ref, lora_name=lora))
        if use_tqdm:
            await _with_bar(futures)
        return [self._output(rid, await fut) for rid, fut in zip(ids, futures)]

    def _output(self, rid: str, p: _Pending) -> RequestOutput:
        outputs = []
        for i, sample in enumerate(p.samples):
            lps = p.logprobs[i]
            cumulative = None
            if lps is not None:
                cumulative = sum(step[tok] for step, tok in zip(lps, sample.token_ids))
            outputs.append(CompletionOutput(i, sample.text, sample.token_ids, sample.finish_reason,
                                            sample.stop_reason, lps, cumulative, sample.error))
        return RequestOutput(rid, p.prompt, p.prompt_token_ids, outputs, p.num_cached_tokens,
                             prompt_logprobs=p.prompt_logprobs, embedding=p.embedding)

    # --- helpers ---------------------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]


def _as_prompt_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return prompts


async def _with_bar(futures: list[asyncio.Future]) -> None:
    """Waits for every prompt, advancing a tqdm bar on stderr as each one finishes."""
    with tqdm(total=len(futures), desc="Processed prompts", dynamic_ncols=True) as bar:
        left = set(futures)
        while left:
            done, left = await asyncio.wait(left, return_when=asyncio.FIRST_COMPLETED)
            bar.update(len(done))
