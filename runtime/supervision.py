"""Supervision policy (what a parent does when a child fails) and the pure restart bookkeeping.

No event loop here: the cell asks RestartTracker for a backoff delay or an escalation."""
from __future__ import annotations

from collections import deque

import msgspec

DIRECTIVES = ("restart", "stop", "escalate")


class Supervision(msgspec.Struct, frozen=True):
    """One-for-one policy: restart up to `max_restarts` times inside `window_s`, waiting an
    exponentially growing backoff; one more failure escalates to the parent."""

    directive: str = "restart"
    max_restarts: int = 3
    window_s: float = 60.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    backoff_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.directive not in DIRECTIVES:
            raise ValueError(f"directive must be one of {DIRECTIVES}, got {self.directive!r}")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("need 0 <= backoff_initial_s <= backoff_max_s")
        if self.backoff_factor < 1.0:
            raise ValueError("backoff_factor must be >= 1")


class RestartTracker:
    """Counts failures inside a sliding window and turns each into a delay or an escalation."""

    def __init__(self, policy: Supervision):
        self.policy = policy
        self._failures: deque[float] = deque()

    def record_failure(self, now: float) -> float | None:
        """Delay in seconds before the restart, or None when the limit is exceeded."""
        p = self.policy
        while self._failures and now - self._failures[0] > p.window_s:
            self._failures.popleft()
        self._failures.append(now)
        n = len(self._failures)
        if n > p.max_restarts:
            return None
        return min(p.backoff_initial_s * p.backoff_factor ** (n - 1), p.backoff_max_s)

    @property
    def recent_failures(self) -> int:
        return len(self._failures)
