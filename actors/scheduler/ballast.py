"""Batch lines as ballast: they ride only in the room interactive requests leave in a step.

A ballast request sorts after every interactive one (so it is admitted last and preempted first,
see Sequence.sort_key). Beyond that ordering, this policy decides three things each step: which
running ballast sequences give their rows (or LoRA adapter slots) back to interactive requests
waiting for one, in which
order the step's token budget is handed out (interactive decodes and prefill chunks before any
ballast), and whether ballast runs at all while interactive latency misses its objective. It only
chooses; the scheduler does the preempting. It never delays an interactive request.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.scheduler.latency import LatencyMeter
from actors.scheduler.sequence import Sequence

# The interactive latency quantile held against the objective, over the last seconds.
OBJECTIVE_QUANTILE = 0.9


@dataclass(frozen=True)
class BallastObjective:
    """Interactive p90 first-token and inter-token latency, in seconds, past which ballast waits
    (None: no objective, ballast always takes what is left)."""

    ttft_s: float | None = None
    itl_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"the ballast {name} objective must be positive, got {value}")


class BallastPolicy:
    def __init__(self, objective: BallastObjective, latency: LatencyMeter):
        self.objective = objective
        self.latency = latency

    def missing_objective(self) -> bool:
        """Interactive latency of the last seconds is past the objective."""
        meter, objective = self.latency, self.objective
        for samples, limit in ((meter.interactive_ttft, objective.ttft_s), (meter.interactive_itl, objective.itl_s)):
            if limit is not None and (p := samples.quantiles(OBJECTIVE_QUANTILE)[0]) is not None and p > limit:
                return True
        return False

    def rows_to_free(self, running: list[Sequence], waiting: list[Sequence], max_num_seqs: int) -> list[Sequence]:
        """Running ballast (newest first) to preempt so that every waiting interactive request has
        a row this step."""
        wanted = sum(not s.request.ballast for s in waiting) - (max_num_seqs - len(running))
        victims = [s for s in reversed(running) if s.request.ballast]
        return victims[:max(wanted, 0)]

    def slots_to_free(self, running: list[Sequence], waiting: list[Sequence], max_loras: int) -> list[Sequence]:
        """Running ballast to preempt so that every waiting interactive request's LoRA adapter has a
        slot: the sequences of adapters that only ballast reads and no interactive request waits for,
        the newest ballast's adapter first, as many adapters as are short."""
        if not max_loras:
            return []
        interactive = {s.request.lora_name for s in running if not s.request.ballast} - {None}
        asked = {s.request.lora_name for s in waiting if not s.request.ballast} - {None}
        ballast_only = list(dict.fromkeys(s.request.lora_name for s in reversed(running) if s.request.ballast
                                          and s.request.lora_name not in interactive | {None}))
        short = len(asked - interactive - set(ballast_only)) - (max_loras - len(interactive) - len(ballast_only))
        gone = [a for a in ballast_only if a not in asked][:max(short, 0)]
        return [s for s in reversed(running) if s.request.ballast and s.request.lora_name in gone]

    def block_victim(self, refused: list[Sequence], running: list[Sequence], budget_left: int) -> Sequence | None:
        """The running ballast to preempt when the pool refused an interactive request that the
        token budget still had room for: the newest; None when the first refused is ballast."""
        if not refused or refused[0].request.ballast or budget_left <= 0:
            return None
        return next((s for s in reversed(running) if s.request.ballast), None)

    def budget_order(self, running: list[Sequence], waiting: list[Sequence]) -> list[Sequence]:
        """Who gets the step's token budget, in order: interactive decodes, interactive prefill
        chunks, then ballast the same way. Ballast sits out entirely while interactive latency
        misses its objective, and its prefill chunks while an interactive request waits to start."""
        interactive = [s for s in running if not s.request.ballast]
        ballast = [s for s in running if s.request.ballast]
        if interactive and self.missing_objective():
            ballast = []
        order = _decodes_first(interactive)
        waits = any(not s.request.ballast for s in waiting)
        return order + [s for s in _decodes_first(ballast) if not (waits and _prefilling(s))]


def _prefilling(seq: Sequence) -> bool:
    return seq.num_tokens - seq.num_computed > 1


def _decodes_first(seqs: list[Sequence]) -> list[Sequence]:
    return [s for s in seqs if not _prefilling(s)] + [s for s in seqs if _prefilling(s)]
