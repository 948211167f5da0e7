"""Observations of the last few seconds and their quantiles, for the live dashboard: what a
Prometheus histogram cannot say without a scraper (p50 and p90 of right now). Bounded memory.

The engine keeps one for its first-token and one for its inter-token latency, and gateways ask
for its stats four times a second to route: the quantiles are recomputed at most every
`refresh_s`, so a busy window is not sorted on the engine's loop for every question.
"""
from __future__ import annotations

import bisect
import time
from collections import deque

WINDOW_S = 10.0
REFRESH_S = 0.5
MAX_ENTRIES = 20_000


class RecentSamples:
    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic, refresh_s: float = 0.0) -> None:
        self.window_s = window_s
        self.refresh_s = refresh_s
        self._clock = clock
        self._entries: deque[tuple[float, float, int]] = deque(maxlen=MAX_ENTRIES)   # (when, value, times)
        self._memo: tuple[float, tuple[float, ...], list[float | None]] | None = None   # (when, qs, answer)

    def add(self, value: float, times: int = 1) -> None:
        self._entries.append((self._clock(), value, times))

    def count(self) -> int:
        """Observations in the window."""
        self._expire(self._clock())
        return sum(n for _, _, n in self._entries)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._entries and self._entries[0][0] < horizon:
            self._entries.popleft()

    def quantiles(self, *qs: float) -> list[float | None]:
        """The `qs` quantiles (0..1) of the window's observations, None for an empty window."""
        now = self._clock()
        if self._memo is not None and self._memo[1] == qs and now - self._memo[0] < self.refresh_s:
            return list(self._memo[2])
        self._expire(now)
        if not self._entries:
            answer: list[float | None] = [None] * len(qs)
        else:
            ordered = sorted((v, n) for _, v, n in self._entries)
            cumulative, total = [], 0
            for _, n in ordered:
                total += n
                cumulative.append(total)
            # The smallest value with at least q of the observations at or below it.
            answer = [ordered[min(bisect.bisect_left(cumulative, q * total), len(ordered) - 1)][0] for q in qs]
        self._memo = (now, qs, answer)
        return list(answer)
