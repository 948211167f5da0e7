"""The scheduler's configuration: built once by the engine from its flags, read by the scheduler and its parts."""

from __future__ import annotations

from dataclasses import dataclass

from actors.scheduler.ballast import BallastObjective


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    priority_scheduling: bool = False   # off: every request is first come, first served
    max_burst: int = 1                  # decode steps one plan may run (actors/worker/decode_burst.py)
    ballast: BallastObjective = BallastObjective()   # when batch lines wait for interactive latency
    max_loras: int = 0                  # distinct LoRA adapters the running sequences may read at once
