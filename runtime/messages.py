"""Framework messages an actor may receive from the runtime itself.

Application messages live with the application; these are the only ones the runtime emits."""
from __future__ import annotations

from typing import Any

import msgspec

from runtime.ref import ActorRef


class Terminated(msgspec.Struct, tag=True, frozen=True):
    """A watched actor stopped (`reason="stopped"`) or its node became unreachable."""

    ref: ActorRef
    reason: str = "stopped"


class Piped(msgspec.Struct, frozen=True):
    """The outcome of an awaitable piped to self (`ActorContext.pipe_to_self`): its result, or the
    exception it raised as `error`. Stays inside its process: it is never registered for the wire."""

    result: Any
    error: BaseException | None = None
