"""Decode bursts, and the brake that ends one early.

At a small batch a decode step's forward takes ~10 ms on the CPU, and each step also pays its round
trip through the event loop: the scheduler plans, the compute thread wakes, runs, hands the tokens
back, the event loop wakes. That round trip is ~1 ms, a tenth of the step. So when every running
sequence decodes and nothing else waits, the scheduler plans a burst (`StepPlan.burst`): it reserves
lookahead KV slots for a few more tokens of each sequence, and the worker runs those steps back to
back on its own thread, feeding each the token the one before sampled. Every step's tokens still go
out as soon as they are sampled (a `StepProgress`), so streams keep their per-token pace; only the
planning round trip is skipped.

The batch of a burst cannot change, so the scheduler pulls the brake whenever it should: a request
arrives or is aborted, a sequence finishes. The worker looks at the brake before each further step
and ends the burst there; the scheduler gives the unused slots back (as after a speculative
verification). The brake is the one thing the two actors share besides messages (they always live
in one process): it is set on the event loop and read on the compute thread, so it is an Event.
"""

from __future__ import annotations

import threading


class BurstBrake:
    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def pull(self) -> None:
        """The batch should change: the burst in flight (if any) ends after the step it is in."""
        self._event.set()

    def release(self) -> None:
        """Before a burst is sent: only what happens from now on ends it."""
        self._event.clear()

    @property
    def pulled(self) -> bool:
        return self._event.is_set()
