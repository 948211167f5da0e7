"""ActorCell: the runtime side of one actor (mailbox, drain task, children, supervision, death).

The drain loop is the hot path: a deque plus one waiter future, no per-message task or log call."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from runtime.actor import Actor, ActorContext
from runtime.errors import ActorDead, Escalated
from runtime.messages import Terminated
from runtime.ref import Ask, LocalRef
from runtime.supervision import RestartTracker, Supervision

if TYPE_CHECKING:
    from runtime.actor import Timer
    from runtime.pipe import Pipe
    from runtime.system import ActorSystem
    from runtime.turns import Turns


class Signal:
    """Runtime-internal mailbox item (never seen by receive())."""

    __slots__ = ("kind", "arg")

    def __init__(self, kind: str, arg: Any):
        self.kind = kind
        self.arg = arg


class ActorCell:
    def __init__(self, system: ActorSystem, parent: ActorCell | None, actor: Any,
                 path: str, supervision: Supervision):
        self.system = system
        self.parent = parent
        self.path = path
        self.loop = system.loop
        # A class or other callable gives a fresh instance on each restart.
        self.factory: Callable[[], Actor] | None = None if isinstance(actor, Actor) else actor
        self.actor: Actor = actor if self.factory is None else self.factory()
        if not isinstance(self.actor, Actor):
            raise TypeError(f"spawn needs an Actor or a factory of Actors, got {type(self.actor).__name__}")
        self.supervision = supervision
        self.restarts = RestartTracker(supervision)
        self.dq: deque[Any] = deque()
        self.waiter: asyncio.Future | None = None
        self.wake: asyncio.Future | None = None   # backoff sleep, cut short by stop
        self.stopping = False
        self.dead = False
        self.children: dict[str, ActorCell] = {}
        self.watchers: dict[object, Callable[[Terminated], None]] = {}
        self.watching: set[Any] = set()
        self.timers: set[Timer] = set()
        self.pipes: set[Pipe | Turns] = set()   # running, or their outcome not yet received
        self.taken: dict[type, Callable[[Any], Any]] = {}   # message kinds a Turns takes from receive
        self.escalation: BaseException | None = None
        self.ref = LocalRef(self)
        self.log = system.log.bind(actor=path)
        self.started = self.loop.create_future()
        self.stopped = self.loop.create_future()
        self.task: asyncio.Task | None = None
        self._bind(self.actor)

    def _bind(self, actor: Actor) -> None:
        actor.context = ActorContext(self)

    # ---- mailbox -------------------------------------------------------------------------
    def put(self, item: Any) -> None:
        if self.dead:
            self._dead_letter(item)
            return
        self.dq.append(item)
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def notify(self) -> None:
        """Resume the drain loop after items were appended to `dq` directly."""
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def post_piped(self, pipe: Pipe) -> None:
        """A pipe finished: its outcome joins the mailbox, in order with everything else."""
        self.put(Signal("piped", pipe))

    def post_turn(self, turns: Turns) -> None:
        """A coroutine run in turns waits to resume: it joins the mailbox like a message."""
        self.put(Signal("turn", turns))

    def _dead_letter(self, item: Any) -> None:
        self.system.dead_letters += 1
        if type(item) is Ask and not item.reply.done():
            item.reply.set_exception(ActorDead(f"actor {self.path!r} is stopped"))

    def request_stop(self) -> asyncio.Future:
        if not self.stopping:
            self.stopping = True
            for fut in (self.waiter, self.wake):
                if fut is not None and not fut.done():
                    fut.set_result(None)
            self.waiter = None
        return self.stopped

    # ---- lifecycle -----------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._start_incarnation()
            if not self.started.done():
                self.started.set_result(None)
            await self._drain()
        finally:
            if not self.started.done():
                self.started.set_result(None)
            await self._terminate()

    async def _start_incarnation(self) -> None:
        try:
            await self.actor.on_start()
        except Exception as exc:
            await self._fail(exc)

    async def _drain(self) -> None:
        dq = self.dq
        loop = self.loop
        receive = self.actor.receive
        taken = self.taken
        while not self.stopping:
            if not dq:
                self.waiter = w = loop.create_future()
                await w
                continue
            item = dq.popleft()
            cls = item.__class__
            if cls is Ask:
                reply = item.reply
                try:
                    result = await receive(item.msg)
                except Exception as exc:
                    # The asker gets the error; the actor itself carries on.
                    if not reply.done():
                        reply.set_exception(exc)
                except BaseException:
                    if not reply.done():
                        reply.set_exception(ActorDead(f"actor {self.path!r} was killed"))
                    raise
                else:
                    if not reply.done():
                        reply.set_result(result)
            elif cls is Signal:
                await self._on_signal(item)
                receive = self.actor.receive
            else:
                try:
                    await (receive(item) if not taken or cls not in taken else taken[cls](item))
                except Exception as exc:
                    await self._fail(exc)
                    receive = self.actor.receive

    async def _on_signal(self, sig: Signal) -> None:
        if sig.kind == "piped":
            pipe = sig.arg
            self.pipes.discard(pipe)
            if pipe.cancelled:  # cancelled after it posted, or by a restart: never delivered
                return
            try:
                await self.actor.receive(pipe.message())
            except Exception as exc:
                await self._fail(exc)
        elif sig.kind == "turn":
            turns = sig.arg
            if turns.cancelled:  # a restart cancelled it while it waited: it never resumes
                return
            error = await turns.resume()
            if error is not None:
                await self._fail(error)
        elif sig.kind == "escalated":
            child_path, cause = sig.arg
            await self._fail(Escalated(child_path, cause))

    async def _fail(self, exc: BaseException) -> None:
        """Apply this actor's supervision policy to a failure of its own."""
        policy = self.supervision
        self.log.error("actor failed", error=repr(exc), exc_info=exc)
        if self.stopping:
            return
        if policy.directive == "stop":
            self.stopping = True
            return
        delay = None if policy.directive == "escalate" else self.restarts.record_failure(time.monotonic())
        if delay is None:
            self.escalation = exc
            self.stopping = True
            return
        self.log.warning("restarting actor", backoff_s=delay, restarts=self.restarts.recent_failures)
        await self._stop_children()
        await self._cancel_pipes()
        await self._call_on_stop()
        if delay > 0:
            self.wake = self.loop.create_future()
            handle = self.loop.call_later(delay, _resolve, self.wake)
            try:
                await self.wake
            finally:
                handle.cancel()
                self.wake = None
        if self.stopping:
            return
        if self.factory is not None:
            self.actor = self.factory()
            self._bind(self.actor)
        await self._start_incarnation()

    async def _call_on_stop(self) -> None:
        try:
            await self.actor.on_stop()
        except Exception as exc:
            self.log.error("on_stop failed", error=repr(exc), exc_info=exc)

    async def _cancel_pipes(self) -> None:
        """The incarnation ends (restart or stop): every pipe and coroutine run in turns is cancelled
        and awaited, and an outcome or a re-entry already in the mailbox is dropped, so nothing of
        this incarnation arrives later."""
        pipes = list(self.pipes)
        for pipe in pipes:
            pipe.cancel()
        running = [pipe.task for pipe in pipes if not pipe.done]
        if running:
            await asyncio.wait(running)

    async def _stop_children(self) -> None:
        kids = list(self.children.values())
        if not kids:
            return
        waits = [c.request_stop() for c in kids]
        await asyncio.wait(waits)

    async def _terminate(self) -> None:
        self.stopping = True
        for t in list(self.timers):
            t.cancel()
        try:
            await self._stop_children()
            await self._cancel_pipes()
            await self._call_on_stop()
        finally:
            self.dead = True
            while self.dq:
                self._dead_letter(self.dq.popleft())
            self.system._on_cell_dead(self)
            note = Terminated(self.ref)
            for deliver in list(self.watchers.values()):
                deliver(note)
            self.watchers.clear()
            if self.parent is not None:
                self.parent.children.pop(self.path.rpartition("/")[2], None)
            if not self.stopped.done():
                self.stopped.set_result(None)
            if self.escalation is not None:
                if self.parent is not None:
                    self.parent.put(Signal("escalated", (self.path, self.escalation)))
                else:
                    self.system._root_failed(self.path, self.escalation)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
