"""Pipe-to-self (Akka's pipeToSelf): an actor awaits a future in a task it owns, and the outcome
comes back to its own mailbox as a message, so receive() never blocks on it.

A pipe never outlives its actor's incarnation: a stop or a restart cancels it, and an outcome it
had already posted is dropped, so a restarted actor never sees a stale result."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.cell import ActorCell


class Owned:
    """A task its actor owns: the actor's cell cancels and awaits it when the incarnation ends (a
    stop or a restart), and drops what it already posted to the mailbox."""

    __slots__ = ("task", "cancelled")

    task: asyncio.Task

    @property
    def done(self) -> bool:
        """The task has finished (what it posted may still wait in the mailbox)."""
        return self.task.done()

    def cancel(self) -> None:
        """Cancel the task if it still runs; either way the actor receives nothing more from it."""
        self.cancelled = True
        self.task.cancel()


class Pipe(Owned):
    """One awaitable piped to its actor; `cancel()` it and its outcome never arrives."""

    __slots__ = ("_cell", "_wrap", "_result", "_error")

    def __init__(self, cell: ActorCell, awaitable: Awaitable[Any],
                 wrap: Callable[[Any, BaseException | None], Any]):
        self._cell = cell
        self._wrap = wrap
        self._result: Any = None
        self._error: BaseException | None = None
        self.cancelled = False
        self.task = cell.loop.create_task(_await(awaitable))   # owned: cancelled and awaited by its actor
        self.task.add_done_callback(self._post)
        cell.pipes.add(self)

    def message(self) -> Any:
        """What the actor receives: `wrap(result, error)`, built when the mailbox reaches it."""
        return self._wrap(self._result, self._error)

    def _post(self, task: asyncio.Task) -> None:
        if self.cancelled:
            self._cell.pipes.discard(self)
            return
        if task.cancelled():  # cancelled from inside, not by its actor: an error like any other
            self._error = asyncio.CancelledError()
        elif (error := task.exception()) is not None:
            self._error = error
        else:
            self._result = task.result()
        self._cell.post_piped(self)


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
