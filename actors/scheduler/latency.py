"""What a request's tokens cost in time: first-token latency (arrival here to first token, split
into its wait and its prefill) and inter-token latency, observed once per token.

Into the engine's counters (histograms for /metrics) and the last seconds' samples (the live
dashboard). Plain bookkeeping, no decisions: the scheduler calls it as tokens come out.
"""

from __future__ import annotations

from collections.abc import Callable

from actors.stats.recent import RecentSamples
from actors.scheduler.counters import Counters
from actors.scheduler.sequence import RequestState, Sequence


class LatencyMeter:
    def __init__(self, counters: Counters, clock: Callable[[], float]):
        self.counters = counters
        self.recent_ttft = RecentSamples(clock=clock)
        self.recent_itl = RecentSamples(clock=clock)   # per token: a step's gap over the tokens it emitted
        # Interactive requests' alone, which batch lines (ballast) must not slow down.
        self.interactive_ttft = RecentSamples(clock=clock)
        self.interactive_itl = RecentSamples(clock=clock)

    def first_token(self, req: RequestState, now: float) -> None:
        """The request's first token (of sample 0) came out at `now`."""
        c = self.counters
        c.ttft_count += 1
        c.ttft_queue_s += req.first_step_s - req.arrived_s
        c.ttft_prefill_s += now - req.first_step_s
        c.ttft.observe(now - req.arrived_s)
        self.recent_ttft.add(now - req.arrived_s)
        if not req.ballast:
            self.interactive_ttft.add(now - req.arrived_s)

    def tokens(self, seq: Sequence, kept: int, now: float) -> None:
        """`kept` tokens of the sequence came out at `now`. A sequence's first tokens here (its first
        ever, or its first after a handoff from a prefill engine) start the clock."""
        if not kept:
            return
        if seq.last_token_s is not None:
            gap = (now - seq.last_token_s) / kept
            self.counters.itl.observe(gap, kept)
            self.recent_itl.add(gap, kept)
            if not seq.request.ballast:
                self.interactive_itl.add(gap, kept)
        seq.last_token_s = now
