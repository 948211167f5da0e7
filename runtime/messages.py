"""Framework messages an actor may receive from the runtime itself.

Application messages live with the application; these are the only ones the runtime emits."""
from __future__ import annotations

import msgspec

from runtime.ref import ActorRef


class Terminated(msgspec.Struct, tag=True, frozen=True):
    """A watched actor stopped (`reason="stopped"`) or its node became unreachable."""

    ref: ActorRef
    reason: str = "stopped"
