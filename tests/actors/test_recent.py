"""The last seconds' quantiles the dashboard draws: weighted by how many times a value was
observed, within 2.5% of the exact quantile, forgetting what left the window, and as cheap to
ask of a busy window as of a quiet one."""
from __future__ import annotations

import math
import random

import pytest

from actors.stats.recent import RecentSamples
from tests.actors.test_scheduler import FakeClock


def exact(values: list[float], q: float) -> float:
    """The smallest value with at least q of the values at or below it."""
    return sorted(values)[max(0, math.ceil(q * len(values)) - 1)]


def test_quantiles_count_each_observation_and_forget_the_old():
    clock = FakeClock()
    r = RecentSamples(window_s=10.0, clock=clock)
    assert r.quantiles(0.5, 0.9) == [None, None] and r.count() == 0
    r.add(1.0, times=9)          # nine tokens at 1 s each, one at 5 s
    r.add(5.0)
    assert r.count() == 10
    assert r.quantiles(0.5, 0.9, 1.0) == [pytest.approx(1.0, rel=0.025), pytest.approx(1.0, rel=0.025),
                                          pytest.approx(5.0, rel=0.025)]
    clock.t = 6.0
    r.add(3.0, times=2)
    assert r.quantiles(0.5, 0.9) == [pytest.approx(1.0, rel=0.025), pytest.approx(3.0, rel=0.025)]
    clock.t = 11.0               # the first second is past the window
    assert r.count() == 2 and r.quantiles(0.5, 0.9) == [3.0, 3.0]   # one value alone is exact
    clock.t = 17.0
    assert r.quantiles(0.5) == [None] and r.count() == 0


def test_quantiles_are_within_two_and_a_half_percent_of_the_exact_ones():
    clock, rng = FakeClock(), random.Random(3)
    r = RecentSamples(window_s=10.0, clock=clock)
    values = []
    for i in range(5000):
        clock.t = i * 0.001
        v = rng.lognormvariate(-4, 1.5)   # milliseconds to seconds
        values.append(v)
        r.add(v)
    for q, got in zip((0.1, 0.5, 0.9, 0.99), r.quantiles(0.1, 0.5, 0.9, 0.99)):
        assert got == pytest.approx(exact(values, q), rel=0.025), q
    r.add(0.0)                   # a zero (or anything under 10 us) is kept, and is the minimum
    assert r.quantiles(0.0) == [0.0]
