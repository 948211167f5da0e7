"""Observations of the last few seconds and their quantiles, for the live dashboard: what a
Prometheus histogram cannot say without a scraper (p50 and p90 of right now).

The engine keeps one for its first-token and one for its inter-token latency on the scheduler's
loop, and gateways ask for its stats four times a second, so neither adding nor asking may cost
more with load: observations go into log-spaced buckets (each 5% wide) per second of arrival, and
a quantile reads at most a window's worth of small bucket maps. A quantile is its bucket's middle,
kept within the smallest and largest value observed: within 2.5% of the exact one.
"""
from __future__ import annotations

import math
import time
from collections import Counter, deque

WINDOW_S = 10.0
SLICE_S = 1.0          # the window moves by whole seconds: it holds the last 10 to 11 s
LOWEST = 1e-5          # values below 10 microseconds share one bucket
RATIO = 1.05           # each bucket's upper bound over its lower one
_LOG_RATIO = math.log(RATIO)


class _Slice:
    __slots__ = ("start", "counts", "low", "high")

    def __init__(self, start: float) -> None:
        self.start = start
        self.counts: Counter[int] = Counter()   # bucket -> observations
        self.low, self.high = math.inf, -math.inf


def _bucket(value: float) -> int:
    return -1 if value < LOWEST else int(math.log(value / LOWEST) / _LOG_RATIO)


def _middle(bucket: int) -> float:
    return 0.0 if bucket < 0 else LOWEST * RATIO ** (bucket + 0.5)


class RecentSamples:
    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._slices: deque[_Slice] = deque()

    def add(self, value: float, times: int = 1) -> None:
        now = self._clock()
        if not self._slices or now >= self._slices[-1].start + SLICE_S:
            self._slices.append(_Slice(now))
            self._expire(now)
        s = self._slices[-1]
        s.counts[_bucket(value)] += times
        s.low, s.high = min(s.low, value), max(s.high, value)

    def count(self) -> int:
        """Observations in the window."""
        self._expire(self._clock())
        return sum(n for s in self._slices for n in s.counts.values())

    def quantiles(self, *qs: float) -> list[float | None]:
        """The `qs` quantiles (0..1) of the window's observations, None for an empty window."""
        self._expire(self._clock())
        counts: Counter[int] = Counter()
        for s in self._slices:
            counts.update(s.counts)
        total = sum(counts.values())
        if not total:
            return [None] * len(qs)
        low = min(s.low for s in self._slices)
        high = max(s.high for s in self._slices)
        ordered = sorted(counts.items())
        out = []
        for q in qs:
            # The smallest bucket with at least q of the observations at or below it.
            need, seen = q * total, 0
            for bucket, n in ordered:
                seen += n
                if seen >= need:
                    break
            out.append(min(max(_middle(bucket), low), high))
        return out

    def _expire(self, now: float) -> None:
        """Drop the seconds that ended before the window began."""
        while self._slices and self._slices[0].start + SLICE_S <= now - self.window_s:
            self._slices.popleft()
