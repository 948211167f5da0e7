"""The last seconds' quantiles the dashboard draws: weighted by how many times a value was
observed, forgetting what left the window, and recomputed at most every `refresh_s`."""
from __future__ import annotations

from actors.recent import RecentSamples
from tests.actors.test_scheduler import FakeClock


def test_quantiles_count_each_observation_and_forget_the_old():
    clock = FakeClock()
    r = RecentSamples(window_s=10.0, clock=clock)
    assert r.quantiles(0.5, 0.9) == [None, None] and r.count() == 0
    r.add(1.0, times=9)          # nine tokens at 1 s each, one at 5 s
    r.add(5.0)
    assert r.count() == 10 and r.quantiles(0.5, 0.9, 1.0) == [1.0, 1.0, 5.0]
    clock.t = 6.0
    r.add(3.0, times=2)
    assert r.quantiles(0.5, 0.9) == [1.0, 3.0]
    clock.t = 10.5               # the first two observations are past the window
    assert r.count() == 2 and r.quantiles(0.5, 0.9) == [3.0, 3.0]
    clock.t = 16.5
    assert r.quantiles(0.5) == [None]


def test_a_refresh_interval_reuses_the_last_answer_until_it_is_due():
    clock = FakeClock()
    r = RecentSamples(window_s=10.0, clock=clock, refresh_s=0.5)
    r.add(2.0)
    assert r.quantiles(0.5, 0.9) == [2.0, 2.0]
    r.add(8.0, times=3)
    clock.t = 0.4
    assert r.quantiles(0.5, 0.9) == [2.0, 2.0]        # within refresh_s: the same answer
    assert r.quantiles(0.5) == [8.0]                  # other quantiles are computed afresh
    clock.t = 0.5
    assert r.quantiles(0.5, 0.9) == [8.0, 8.0]
