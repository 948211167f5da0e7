"""Turns: a coroutine an actor runs as one long handler that lets the mailbox flow while it waits
(Proto.Actor's ReenterAfter; Akka's pipeToSelf with the rest of the coroutine as the message).

In its turn the coroutine is the actor: no message is handled meanwhile, so it reads and changes the
actor's state as a handler does. `await turns.reenter_after(aw)` ends the turn: messages are handled
while `aw` runs, and once `aw` is done the coroutine queues behind them in the mailbox and resumes in
its next turn. `reenter_after(aw, take=(Kind, handler))` also gives the coroutine the messages of one
kind that arrive while `aw` runs (Erlang's selective receive): each goes to `handler` in its place in
the mailbox, as `receive` would have had it, up to the resumption. Like a pipe, it never outlives its
actor's incarnation."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from runtime.pipe import Owned

if TYPE_CHECKING:
    from runtime.cell import ActorCell


class Turns(Owned):
    """One coroutine run in turns (`ActorContext.run_in_turns`); `cancel()` it and it never resumes."""

    __slots__ = ("_cell", "_back", "_turn", "_taken", "away")

    def __init__(self, cell: ActorCell, fn: Callable[[Turns], Awaitable[Any]]):
        self._cell = cell
        self._back: asyncio.Future | None = cell.loop.create_future()   # the turn it holds is given back
        self._turn: asyncio.Future | None = None   # the mailbox reached its re-entry
        self._taken: type | None = None   # the kind of message it takes from receive while away
        self.cancelled = False
        self.away = False   # out of its turn: awaiting in reenter_after, or queued to resume
        self.task = cell.loop.create_task(self._run(fn))   # owned: cancelled and awaited by its actor
        cell.pipes.add(self)

    async def first_turn(self) -> None:
        """Lend the caller's turn to the coroutine (await this from a handler, from on_start or from
        another coroutine's turn): returns once the coroutine first leaves its turn or ends. What it
        raised in that turn is raised here, as if the caller had raised it."""
        error = await self._back
        if error is not None:
            raise error

    async def reenter_after(self, awaitable: Awaitable[Any],
                            take: tuple[type, Callable[[Any], Awaitable[None]]] | None = None) -> Any:
        """End this turn and await `awaitable` while the actor handles its messages; resume in mailbox
        order, after the messages that arrived meanwhile, with its result or raising its exception (a
        cancellation from inside as a RuntimeError). The awaitable starts before any message is
        handled. `take=(Kind, handler)`: until the resumption, each message of class Kind goes to
        `await handler(msg)` instead of `receive`, in mailbox order (a failure in it fails the actor
        as one in receive does). A stop or a restart of the actor while it waits cancels both the
        awaitable and the coroutine (CancelledError, not to be caught), and gives Kind back to receive."""
        self.away = True
        self._back.set_result(None)
        self._back = None
        if take is not None:
            self._take(*take)
        try:
            result, error = await self._settle(awaitable)
            self._turn = self._cell.loop.create_future()
            self._cell.post_turn(self)
            await self._turn
        finally:
            self._give_back()
        self._turn, self.away = None, False
        if error is not None:
            raise error
        return result

    def cancel(self) -> None:
        self._give_back()
        super().cancel()

    def _take(self, kind: type, handler: Callable[[Any], Awaitable[None]]) -> None:
        taken = self._cell.taken
        if kind in taken:
            raise RuntimeError(f"{kind.__name__} messages are taken already")
        taken[kind], self._taken = handler, kind

    def _give_back(self) -> None:
        if self._taken is not None:
            self._cell.taken.pop(self._taken, None)
            self._taken = None

    async def resume(self) -> BaseException | None:
        """The mailbox reached the coroutine's re-entry (called by its actor's drain loop): it runs its
        turn; returns once it gives the turn back, with what it raised in that turn."""
        self._back = self._cell.loop.create_future()
        self._turn.set_result(None)
        return await self._back

    async def _run(self, fn: Callable[[Turns], Awaitable[Any]]) -> None:
        error: BaseException | None = None
        try:
            _, error = await self._settle(fn(self))
        finally:
            self._cell.pipes.discard(self)
            if self._back is not None and not self._back.done():
                self._back.set_result(error)

    async def _settle(self, awaitable: Awaitable[Any]) -> tuple[Any, BaseException | None]:
        """(result, None) or (None, its exception); a cancellation by the actor goes on up."""
        try:
            return await awaitable, None
        except asyncio.CancelledError:
            if self.cancelled:
                raise
            return None, _cancelled_inside()
        except Exception as e:
            return None, e


def _cancelled_inside() -> RuntimeError:
    """Cancelled from inside, not by its actor: an error like any other (a CancelledError raised in a
    turn would look like the actor being cancelled)."""
    return RuntimeError("cancelled, though its actor did not cancel it")
