"""The draft worker actor: answers each Propose with Proposals, computed on its own thread.

A thin shell around a proposer (`build_proposer` picks it from the speculative config). Model
drafts run on a dedicated thread like the target's forward, so the event loop keeps serving.
The scheduler orders draft and target steps, so a layer-skip draft may share the target's KV.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.draft.config import SpeculativeConfig
from actors.draft.messages import DraftStats, GetDraftStats, Propose, Proposals
from actors.draft.ngram import NgramConfig
from actors.draft.proposer import ModelProposer, NgramProposer, Proposer, check_same_vocab
from actors.worker.model_runner import ModelRunner
from runtime import Actor


def build_proposer(spec: SpeculativeConfig, target: ModelRunner | None, *, dtype: str = "float32",
                   kernels: str = "auto", device: str = "cpu", num_threads: int | None = None,
                   seed: int = 0) -> tuple[Proposer, float]:
    """The proposer for `spec`, and one drafted token's cost relative to a target decode step."""
    if spec.method == "ngram":
        return ngram_proposer(spec)
    if target is None:
        raise ValueError(f"speculative method {spec.method!r} needs the target model")
    layers = target.model_config.num_layers
    spec.check_against_target(layers)
    if spec.method == "layerskip":
        proposer = ModelProposer(target, target.kv_caches[:spec.draft_layers], shares_target_kv=True, seed=seed)
        return proposer, spec.resolved_draft_cost(layers)
    return draft_model_proposer(spec, target.block_size, target.num_blocks, layers, count_params(target),
                                lambda draft: check_same_vocab(target, draft), dtype=dtype, kernels=kernels,
                                device=device, num_threads=num_threads, seed=seed)


def ngram_proposer(spec: SpeculativeConfig) -> tuple[Proposer, float]:
    cfg = NgramConfig(spec.ngram_min, spec.ngram_max, spec.num_speculative_tokens)
    return NgramProposer(cfg), spec.resolved_draft_cost(1)


def draft_model_proposer(spec: SpeculativeConfig, block_size: int, num_blocks: int, target_layers: int,
                         target_params: int, check_vocab: Callable[[ModelRunner], None], *,
                         dtype: str = "float32", kernels: str = "auto", device: str = "cpu",
                         num_threads: int | None = None, seed: int = 0) -> tuple[Proposer, float]:
    """A separate draft model with its own KV pool in the target's geometry (its cache is addressed
    by the target's block tables); `check_vocab(draft)` raises when it speaks another vocabulary."""
    draft = ModelRunner(spec.model, dtype=dtype, kernels=kernels, block_size=block_size,
                        num_blocks=num_blocks, device=device, num_threads=num_threads)
    check_vocab(draft)
    cost = spec.resolved_draft_cost(target_layers, count_params(draft), target_params)
    return ModelProposer(draft, draft.kv_caches, shares_target_kv=False, seed=seed), cost


def count_params(runner: ModelRunner) -> int:
    model = runner.model
    tensors = [model.lm_head] + [t for layer in model.layers for t in vars(layer).values() if t is not None]
    return sum(t.numel() for t in tensors)


class DraftWorkerActor(Actor):
    def __init__(self, make_proposer: Callable[[], tuple[Proposer, float]]):
        self._make_proposer = make_proposer
        self.proposer: Proposer | None = None
        self.draft_cost = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self.steps = 0
        self.draft_s = 0.0

    async def on_start(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="matinee-draft")
        if self.proposer is None:  # a draft model loads its weights off the loop
            loop = asyncio.get_running_loop()
            self.proposer, self.draft_cost = await loop.run_in_executor(self._executor, self._make_proposer)

    async def on_stop(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def receive(self, msg: Any) -> Any:
        match msg:
            case Propose():
                return await asyncio.get_running_loop().run_in_executor(self._executor, self._step, msg)
            case GetDraftStats():
                return DraftStats(self.proposer.num_seqs, self.steps, self.draft_s, self.draft_cost)
        return await super().receive(msg)

    def _step(self, msg: Propose) -> Proposals:
        t0 = time.perf_counter()
        proposals = self.proposer.step(msg)
        elapsed = time.perf_counter() - t0
        self.steps += 1
        self.draft_s += elapsed
        return Proposals(msg.step_id, proposals, elapsed)
