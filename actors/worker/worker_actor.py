"""The model worker actor: runs each StepPlan (forward + sampling) on its own compute thread.

A thin shell around ModelRunner and the sampler. The model is built (see `build_runner`), and every
forward runs, on one dedicated thread, so the event loop keeps serving messages (and streams) meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from actors.messages import GetWorkerInfo, SeqOutput, StepPlan, StepResult, TokenLogprobs, WorkerInfo
from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.model_runner import ModelRunner
from actors.worker.sampler import Sampler, SamplingState
from runtime import Actor


def compute_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="matinee-forward")


async def build_runner(make_runner: Callable[[], ModelRunner], executor: ThreadPoolExecutor) -> ModelRunner:
    """Loads the model on the compute thread (seconds of work, off the loop); a model that cannot be
    loaded raises its one clear error here, before any actor exists."""
    return await asyncio.get_running_loop().run_in_executor(executor, make_runner)


class WorkerActor(Actor):
    def __init__(self, runner: ModelRunner, executor: ThreadPoolExecutor, seed: int = 0):
        self.runner = runner
        self.states: dict[int, SamplingState] = {}
        self._executor: ThreadPoolExecutor | None = executor
        self._generator = torch.Generator(runner.device).manual_seed(seed)
        self._sampler = Sampler()         # used on the compute thread only

    async def on_start(self) -> None:
        self.states.clear()  # a restarted worker forgets sequences; the scheduler fails their step

    async def on_stop(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)  # never block the loop on a forward
            self._executor = None

    async def receive(self, msg: Any) -> Any:
        match msg:
            case StepPlan():
                return await asyncio.get_running_loop().run_in_executor(self._executor, self.step, msg)
            case GetWorkerInfo():
                r = self.runner
                return WorkerInfo(r.num_blocks, r.block_size, r.max_model_len, r.model_config.vocab_size,
                                  list(r.eos_token_ids))
        return await super().receive(msg)

    def step(self, plan: StepPlan) -> StepResult:
        """Runs on the compute thread."""
        t0 = time.perf_counter()
        for sid in plan.finished_seq_ids:
            self.states.pop(sid, None)
        for new in plan.new_seqs:
            self.states[new.seq_id] = SamplingState(new.params, new.prompt_token_ids, new.seed, self.runner.device)
        batch = ForwardBatch([SequenceInput(s.token_ids, s.start_pos, s.block_table) for s in plan.seqs])
        logits = self.runner.execute(batch)
        rows = [i for i, s in enumerate(plan.seqs) if s.sample]
        outputs = []
        if rows:
            states = [self.states[plan.seqs[i].seq_id] for i in rows]
            picked = logits if len(rows) == len(plan.seqs) else logits[rows]
            sampled = self._sampler.sample(picked, states, self._generator)
            for i, state, token, lp in zip(rows, states, sampled.token_ids, sampled.logprobs):
                state.append([token])
                outputs.append(SeqOutput(plan.seqs[i].seq_id, [token], None if lp is None else [TokenLogprobs(*lp)]))
        return StepResult(plan.step_id, outputs, self.runner.last_forward_s, time.perf_counter() - t0)
