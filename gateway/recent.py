"""Observations of the last few seconds and their quantiles, for the live dashboard: what a
Prometheus histogram cannot say without a scraper (p50 and p90 of right now). Bounded memory."""
from __future__ import annotations

import bisect
import time
from collections import deque

WINDOW_S = 10.0
MAX_ENTRIES = 20_000


class RecentSamples:
    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._entries: deque[tuple[float, float, int]] = deque(maxlen=MAX_ENTRIES)   # (when, value, times)

    def add(self, value: float, times: int = 1) -> None:
        self._entries.append((self._clock(), value, times))

    def quantiles(self, *qs: float) -> list[float | None]:
        """The `qs` quantiles (0..1) of the window's observations, None for an empty window."""
        horizon = self._clock() - self.window_s
        while self._entries and self._entries[0][0] < horizon:
            self._entries.popleft()
        if not self._entries:
            return [None] * len(qs)
        ordered = sorted((v, n) for _, v, n in self._entries)
        cumulative, total = [], 0
        for _, n in ordered:
            total += n
            cumulative.append(total)
        # The smallest value with at least q of the observations at or below it.
        return [ordered[min(bisect.bisect_left(cumulative, q * total), len(ordered) - 1)][0] for q in qs]
