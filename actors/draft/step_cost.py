"""What drafting costs, learned from the steps' measured wall times.

The controller weighs each drafted position against a plain decode step. That ratio depends on the
hardware, the model and the batch: near 0 on a GPU, where a decode step is memory-bound and a few
more positions ride along for free; on a CPU core with a 135M model in float32 the first few rows
ride along with the weight reads and more turn the matmuls compute-bound (9 rows cost twice one),
so the cost is not even linear in the drafted tokens. It is measured over a window of recent
pure-decode steps: a step shape (sequences, drafted tokens) seen a few times costs its median time;
any other is read off a fit, t = a + c * drafted + f * [any drafts] + b * sequences (least squares
over the shapes' medians, so a step stalled by the machine moves nothing; f is what a step pays
once for drafting at all: the draft worker's round trip, the multi-row attention path, the
rejection sampler). The times cover everything a draft adds to a step. Until the window holds
enough steps with different draft counts, the configured prior is used; a column of the fit the
window cannot tell apart is left out.
"""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np

MAX_RELATIVE_COST = 4.0
MIN_SHAPE_STEPS = 3   # steps of one shape before its own median replaces the fitted line
REFIT_EVERY = 8       # new steps between fits once there is one (a fit costs ~0.3 ms, a step ~0.1 s)


class StepCostModel:
    def __init__(self, prior: float, window: int = 64, min_steps: int = 8) -> None:
        if prior < 0:
            raise ValueError(f"prior cost must be non-negative, got {prior}")
        self.prior = prior
        self.min_steps = min_steps
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float, float, float] | None = None   # (a, c, f, b); None: the prior
        self._medians: dict[tuple[int, int], tuple[float, int]] = {}   # shape -> (median seconds, steps)
        self._new_steps = 0   # observed since the last fit

    def observe(self, num_seqs: int, num_drafted: int, seconds: float) -> None:
        """One pure-decode step: `num_seqs` sequences, `num_drafted` drafted tokens verified in all."""
        if num_seqs < 1 or num_drafted < 0 or not seconds > 0:
            return
        self._steps.append((num_seqs, num_drafted, seconds))
        self._new_steps += 1

    def relative(self, num_seqs: int, k: int = 1, drafting: int | None = None) -> float:
        """Per drafted token, over a plain decode step of `num_seqs` sequences, when `drafting` of
        them (default: all) draft k each: (step time with drafting * k drafted rows - plain step
        time) / (drafted rows * plain step time). With all drafting, the once-per-step cost of
        drafting is shared by the most tokens and the rows add up (on a CPU a step's time is far from
        linear in its rows); with one, it pays that once-per-step cost alone."""
        if self._refit() is None or num_seqs < 1 or k < 1:
            return self.prior
        plain = self.step_time(num_seqs, 0)
        if plain <= 0:
            return self.prior
        drafted = (num_seqs if drafting is None else drafting) * k
        per_token = (self.step_time(num_seqs, drafted) - plain) / (drafted * plain)
        return min(max(per_token, 0.0), MAX_RELATIVE_COST)

    def step_time(self, num_seqs: int, num_drafted: int) -> float:
        """Seconds a pure-decode step of that shape takes: the median of the window's steps of that
        shape where it holds a few, else the fitted line. (On a CPU the cost is far from linear in
        the rows: a few more rows ride along with the weight reads, then the matmuls turn
        compute-bound; the medians see that, the line does not.)"""
        a, c, f, b = self._refit() or (0.0, 0.0, 0.0, 0.0)
        seen = self._medians.get((num_seqs, num_drafted))
        if seen is not None and seen[1] >= MIN_SHAPE_STEPS:
            return seen[0]
        return a + b * num_seqs + (c * num_drafted + f if num_drafted else 0.0)

    @property
    def measured(self) -> bool:
        return self._refit() is not None

    def _refit(self) -> tuple[float, float, float, float] | None:
        if self._new_steps == 0 or (self._fit is not None and self._new_steps < REFIT_EVERY):
            return self._fit
        self._new_steps = 0
        self._fit = None
        if len(self._steps) < self.min_steps:
            return None
        # The median time of each (sequences, drafted) shape, weighted by how often it ran: a step
        # stalled by something else on the machine moves no median.
        times: dict[tuple[int, int], list[float]] = defaultdict(list)
        for n, x, t in self._steps:
            times[n, x].append(t)
        shapes = np.asarray(list(times), dtype=np.float64)
        seqs, drafted = shapes[:, 0], shapes[:, 1]
        t = np.asarray([np.median(v) for v in times.values()])
        self._medians = {shape: (float(m), len(v)) for (shape, v), m in zip(times.items(), t)}
        w = np.sqrt([len(v) for v in times.values()])
        if np.unique(drafted).size < 2:
            return None  # nothing to tell a draft's cost from the step's own
        # Intercept and per-token slope always; the once-per-step and per-sequence terms only when
        # the shapes tell them apart (no drafting-free steps, or a single batch size: a absorbs them).
        columns, names = [np.ones_like(t), drafted], ["a", "c"]
        for name, col in (("f", (drafted > 0).astype(np.float64)), ("b", seqs)):
            trial = np.stack(columns + [col], axis=1)
            if np.linalg.matrix_rank(trial) == trial.shape[1] and len(t) > trial.shape[1]:
                columns.append(col)
                names.append(name)
        x = np.stack(columns, axis=1)
        coef, *_ = np.linalg.lstsq(x * w[:, None], t * w, rcond=None)
        if not np.all(np.isfinite(coef)):
            return None
        got = dict(zip(names, map(float, coef)))
        self._fit = (got["a"], got["c"], got.get("f", 0.0), got.get("b", 0.0))
        return self._fit
