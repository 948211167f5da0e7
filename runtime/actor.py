"""The Actor base class and the ActorContext an actor uses to reach the runtime.

An actor owns its state; its receive() runs one message at a time, so it never needs a lock."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from runtime.messages import Piped
from runtime.pipe import Pipe
from runtime.ref import ActorRef
from runtime.turns import Turns

if TYPE_CHECKING:
    from runtime.cell import ActorCell
    from runtime.supervision import Supervision
    from runtime.system import ActorSystem


class Actor:
    """Subclass and override `receive`; `on_start` is also where a restarted actor rebuilds
    its state (a restart reuses the instance unless spawn was given a factory)."""

    context: ActorContext

    async def on_start(self) -> None:
        """Runs before the first message, and again after each restart (then once on_stop has
        run). If it raises, the actor has failed: its supervision restarts, stops or escalates."""

    async def receive(self, msg: Any) -> Any:
        """Runs for each message, one at a time. An exception goes to the asker of an ask; after a
        tell it fails the actor (supervision decides). Await nothing slow here: pipe it to self."""
        raise TypeError(f"{type(self).__name__} does not handle {type(msg).__name__}")

    async def on_stop(self) -> None:
        """Runs when the actor stops and before a restart, after its children stopped and its
        pipes were cancelled (none will deliver). An exception is logged and changes nothing."""


class Timer:
    """A cancellable timer that posts a message to its actor once or repeatedly."""

    __slots__ = ("_cell", "_msg", "_interval", "_handle", "_deadline")

    def __init__(self, cell: ActorCell, msg: Any, delay: float, interval: float | None):
        self._cell = cell
        self._msg = msg
        self._interval = interval
        self._deadline = cell.loop.time() + delay
        self._handle = cell.loop.call_at(self._deadline, self._fire)
        cell.timers.add(self)

    def _fire(self) -> None:
        cell = self._cell
        cell.put(self._msg)
        if self._interval is None or cell.stopping:
            cell.timers.discard(self)
            self._handle = None
            return
        # call_at on a fixed grid so a repeating timer does not drift with loop latency.
        self._deadline += self._interval
        self._handle = cell.loop.call_at(self._deadline, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._cell.timers.discard(self)

    @property
    def active(self) -> bool:
        return self._handle is not None


class ActorContext:
    """What an actor may do besides handling messages: spawn, watch, timers, stop."""

    __slots__ = ("_cell",)

    def __init__(self, cell: ActorCell):
        self._cell = cell

    @property
    def self_ref(self) -> ActorRef:
        return self._cell.ref

    @property
    def system(self) -> ActorSystem:
        return self._cell.system

    @property
    def parent(self) -> ActorRef | None:
        p = self._cell.parent
        return p.ref if p is not None else None

    @property
    def children(self) -> list[ActorRef]:
        return [c.ref for c in self._cell.children.values()]

    @property
    def log(self) -> Any:
        return self._cell.log

    async def spawn(self, actor: Any, name: str | None = None, *,
                    supervision: Supervision | None = None) -> ActorRef:
        """Start a child; `actor` is an Actor instance or a zero-argument factory."""
        return await self._cell.system._spawn(self._cell, actor, name, supervision)

    def watch(self, ref: ActorRef) -> None:
        """Receive `Terminated(ref)` when `ref` stops or its node becomes unreachable."""
        self._cell.system._watch(self._cell, ref)

    def unwatch(self, ref: ActorRef) -> None:
        self._cell.system._unwatch(self._cell, ref)

    def schedule_once(self, delay_s: float, msg: Any) -> Timer:
        if delay_s < 0:
            raise ValueError("delay_s must be >= 0")
        return Timer(self._cell, msg, delay_s, None)

    def schedule_repeating(self, interval_s: float, msg: Any) -> Timer:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        return Timer(self._cell, msg, interval_s, interval_s)

    def pipe_to_self(self, awaitable: Awaitable[Any],
                     wrap: Callable[[Any, BaseException | None], Any] = Piped) -> Pipe:
        """Await `awaitable` in a task this actor owns; when it finishes, `wrap(result, error)`
        (a `Piped` by default) arrives in this actor's mailbox, in order with other messages.
        A stop or a restart cancels the task and drops an outcome not yet received."""
        return Pipe(self._cell, awaitable, wrap)

    def run_in_turns(self, fn: Callable[[Turns], Awaitable[Any]]) -> Turns:
        """Run `fn(turns)` in a task this actor owns, as one long handler that lets the mailbox flow
        while it waits: in its turn it is the actor (no message is handled meanwhile), and
        `await turns.reenter_after(aw)` hands the mailbox back until `aw` is done, then resumes in
        mailbox order. Its first turn is the caller's own: the caller must `await turns.first_turn()`
        at once. What it raises in a later turn fails the actor, as a handler's exception after a tell
        does. A stop or a restart cancels it (on_stop runs after), and it never resumes."""
        return Turns(self._cell, fn)

    def stop(self) -> None:
        """Stop this actor after the current message (children first, then on_stop)."""
        self._cell.request_stop()
