"""Batch lines as ballast: they ride only in the room interactive requests leave in a step.

A ballast request sorts after every interactive one (so it is admitted last and preempted first,
see Sequence.sort_key). Beyond that ordering, this policy decides four things each step: which
running ballast sequences it displaces, giving their rows, LoRA adapter slots or blocks back to
interactive requests waiting for them, in which order the step's token budget is handed out
(interactive decodes and prefill chunks before any ballast), how many tokens ballast may add to a
step that interactive requests are in (as many as keep the step within its slack of what it would
take without them, by the measured cost of a row: step_cost.py), and whether ballast runs at all
while interactive latency misses its objective. It only chooses; the scheduler does the preempting.
It never delays an interactive request by more than the slack.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from actors.scheduler.latency import LatencyMeter
from actors.scheduler.sequence import Sequence
from actors.scheduler.step_cost import StepCost

# The interactive latency quantile held against the objective, over the last seconds.
OBJECTIVE_QUANTILE = 0.9


@dataclass(frozen=True)
class BallastObjective:
    """Interactive p90 first-token and inter-token latency, in seconds, past which ballast waits
    (None: no objective); `step_slack`: how much longer, as a fraction, a step with interactive
    requests in it may take for the ballast it carries (None: ballast takes whatever is left)."""

    ttft_s: float | None = None
    itl_s: float | None = None
    step_slack: float | None = 0.1

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"the ballast {name} objective must be positive, got {value}")
        if self.step_slack is not None and self.step_slack < 0:
            raise ValueError(f"the ballast step slack must be 0 or more, got {self.step_slack}")


class BallastPolicy:
    def __init__(self, objective: BallastObjective, latency: LatencyMeter):
        self.objective = objective
        self.latency = latency
        self.cost = StepCost()   # what a row adds to a decode step here, from the steps run

    def room(self, interactive_tokens: int) -> float:
        """Tokens ballast may add to a step that gives interactive requests `interactive_tokens`:
        all there are (inf) in a step without them, with no slack set, or while a row's cost is not
        known yet; else those that keep the step within its slack."""
        slack = self.objective.step_slack
        if not interactive_tokens or slack is None:
            return float("inf")
        rows = self.cost.rows_within(interactive_tokens, slack)
        return float("inf") if rows is None else rows

    def admissions(self, admits: list[Sequence], budget: int, room: float) -> tuple[list[Sequence], int]:
        """The step's admissions and their token budget: beside interactive ones (in this step or
        admitted in it), ballast prompts only within `room`, and none beside an interactive prompt
        starting (its first token must not wait for a batch line's prefill)."""
        if self.objective.step_slack is None:
            return admits, budget
        interactive = [s for s in admits if not s.request.ballast]
        if interactive:
            return interactive, budget
        if room < 1:
            return [], budget
        return admits, int(min(budget, room))

    def missing_objective(self) -> bool:
        """Interactive latency of the last seconds is past the objective."""
        meter, objective = self.latency, self.objective
        for samples, limit in ((meter.interactive_ttft, objective.ttft_s), (meter.interactive_itl, objective.itl_s)):
            if limit is not None and (p := samples.quantiles(OBJECTIVE_QUANTILE)[0]) is not None and p > limit:
                return True
        return False

    def displaced(self, running: list[Sequence], waiting: list[Sequence], max_num_seqs: int, max_loras: int,
                  keep: set[int]) -> list[Sequence]:
        """Running ballast to preempt at the start of a step, each once: the rows every waiting
        interactive request needs, then the LoRA adapter slots; none whose seq id is in `keep` (a
        fork parent keeps its blocks until it forked)."""
        rows = self.rows_to_free(running, waiting, max_num_seqs)
        slots = self.slots_to_free(running, waiting, max_loras)
        return [s for s in dict.fromkeys(rows + slots) if s.seq_id not in keep]

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


def count_rows(seqs: Iterable[Sequence | None]) -> int:
    """The ballast among a step's sequences (None: one gone meanwhile, not counted), for the counters."""
    return sum(1 for s in seqs if s is not None and s.request.ballast)


def _prefilling(seq: Sequence) -> bool:
    return seq.num_tokens - seq.num_computed > 1


def _decodes_first(seqs: list[Sequence]) -> list[Sequence]:
    return [s for s in seqs if not _prefilling(s)] + [s for s in seqs if _prefilling(s)]
