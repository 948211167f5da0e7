"""What one more row costs a decode step here, measured: a straight line through the recent decode
steps' forward times against their rows (seconds = fixed + per_row x rows), least squares with the
older steps fading.

On a GPU a decode step reads the weights whatever its rows, so a row costs almost nothing (the
line is flat); on a CPU each row is arithmetic of its own, and a step of 16 rows can take twice
one of 8. Batch lines (ballast.py) ride in a step with interactive requests only as far as this
line says they keep that step within its slack. Plain arithmetic, no decisions.
"""

from __future__ import annotations

# Each new step weighs 1, the one before it FADE, the one before that FADE^2...: about the last
# 1 / (1 - FADE) steps count, so the line follows the machine as its load changes.
FADE = 0.98
# Rows counts must differ this much (their spread, in rows) before the slope is read from them.
MIN_ROW_SPREAD = 0.5
# A row costing less than this (seconds) is a row costing nothing: rounding, not arithmetic.
FREE_ROW_S = 1e-7


class StepCost:
    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step (no prompt tokens in it) of `rows` rows took `seconds` of forward."""
        if rows <= 0 or seconds <= 0:
            return
        f = FADE
        self._w, self._x, self._y = f * self._w + 1, f * self._x + rows, f * self._y + seconds
        self._xx, self._xy = f * self._xx + rows * rows, f * self._xy + rows * seconds

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row) of the recent steps; None until their row counts spread."""
        if self._w <= 0:
            return None
        spread = self._xx / self._w - (self._x / self._w) ** 2
        if spread < MIN_ROW_SPREAD ** 2:
            return None
        per_row = (self._xy / self._w - (self._x / self._w) * (self._y / self._w)) / spread
        return self._y / self._w - per_row * self._x / self._w, per_row

    def rows_within(self, rows: int, slack: float) -> int | None:
        """How many rows a step of `rows` rows may add and take at most (1 + slack) times as long;
        None where nothing is known yet or a row costs nothing measurable (no limit)."""
        line = self.line()
        if line is None or line[1] < FREE_ROW_S:
            return None
        fixed, per_row = line
        alone = max(fixed + per_row * rows, per_row * rows)
        return int(slack * alone / per_row)
