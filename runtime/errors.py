"""Errors the runtime raises to callers of tell/ask and to supervisors.

Every error here can cross a process boundary by name (see the transport's error replies)."""
from __future__ import annotations


class ActorDead(Exception):
    """The target actor is stopped, unknown, or lives on a node that became unreachable."""


class AskTimeout(TimeoutError):
    """No reply came within the ask's timeout."""


class RemoteError(Exception):
    """A handler on another node raised; carries the original type name and message."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


class Escalated(Exception):
    """A child failed past its restart limit; its parent fails with this error in turn."""

    def __init__(self, child_path: str, cause: BaseException):
        super().__init__(f"child {child_path!r} failed past its restart limit: {cause!r}")
        self.child_path = child_path
        self.cause = cause
