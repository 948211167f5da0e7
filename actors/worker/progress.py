"""A one-line progress bar for weight loading, drawn only when stderr is a terminal.

Logs and CI output stay clean: when stderr is not a tty nothing is written at all.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


class LoadProgress:
    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = bool(getattr(self._stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        self._last_draw = 0.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        # Redrawing for every tensor costs more than it shows; ~10 frames a second is plenty.
        if self._enabled and (now - self._last_draw > 0.1 or self.done >= self.total):
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        if self._enabled:
            self._draw(time.monotonic())
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        self._stream.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} {now - self._start:5.1f}s")
        self._stream.flush()
