"""First-token and inter-token latency (the scheduler's LatencyMeter), through the scheduler with
the real KV manager and the paged fake model (tests/actors/test_scheduler.py), on a fake clock."""
from __future__ import annotations

import pytest

from tests.actors.test_scheduler import FakeClock, Harness


def test_the_engine_measures_first_token_and_inter_token_latency_per_token():
    clock = FakeClock()
    h = Harness(clock=clock)
    h.submit("a", [3, 4, 5, 6], max_tokens=5, ignore_eos=True)   # arrives at 0
    for t in (0.2, 0.3, 0.4, 0.6, 0.7):   # prefill and the first token, then four decodes
        clock.t = t
        h.step()
    assert len(h.outputs[("a", 0)]) == 5 and h.finish[("a", 0)] == "length"
    ttft, itl = h.scheduler.latency.recent_ttft, h.scheduler.latency.recent_itl
    assert ttft.count() == 1 and ttft.quantiles(0.5, 0.9) == [pytest.approx(0.2)] * 2
    assert itl.count() == 4                     # one per token after the first
    assert itl.quantiles(0.5, 0.9) == [pytest.approx(0.1, rel=0.025), pytest.approx(0.2, rel=0.025)]
    clock.t = 0.7 + 11.5                        # past the window: nothing recent
    assert ttft.quantiles(0.5, 0.9) == [None, None] and itl.count() == 0
