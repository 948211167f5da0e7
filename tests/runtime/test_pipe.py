"""Pipe-to-self: an awaitable's outcome arrives as a message, in mailbox order; a stop or a restart
cancels it and drops an outcome not yet received."""
import asyncio

from runtime import Actor, Piped, Supervision

FAST = Supervision(max_restarts=5, window_s=10.0, backoff_initial_s=0.001, backoff_max_s=0.01)


class Piper(Actor):
    """Pipes what it is told to; records every message and which piped coroutines were cancelled."""

    def __init__(self):
        self.got: list = []
        self.cancelled: list[str] = []
        self.pipes_done_in_on_stop: list[bool] = []
        self.arrived = asyncio.Event()
        self.pipes: dict[str, object] = {}

    async def on_stop(self):
        self.pipes_done_in_on_stop = [p.done for p in self.pipes.values()]

    async def receive(self, msg):
        match msg:
            case ("pipe", name, fut):
                self.pipes[name] = self.context.pipe_to_self(self._wait(name, fut))
            case ("wrapped", fut):
                self.context.pipe_to_self(fut, lambda result, error: ("wrapped", result, error))
            case ("posted", name, then):   # pipe something done at once, let it post, then `then`
                self.pipes[name] = self.context.pipe_to_self(_value(name))
                for _ in range(5):   # the task ends, then its done callback posts the outcome
                    await asyncio.sleep(0)
                if then == "fail":
                    raise RuntimeError("restart with the outcome in the mailbox")
                self.pipes[name].cancel()
            case "get":
                return list(self.got)
            case _:
                self.got.append(msg)
                self.arrived.set()

    async def _wait(self, name, fut):
        try:
            return await asyncio.shield(fut)   # the test resolves it later
        except asyncio.CancelledError:
            self.cancelled.append(name)
            raise


async def _value(v):
    return v


async def test_the_result_arrives_as_a_message_and_receive_never_waits_for_it(system):
    actor = Piper()
    ref = await system.spawn(actor, name="p")
    fut = system.loop.create_future()
    ref.tell(("pipe", "a", fut))
    ref.tell("before")
    assert await ref.ask("get") == ["before"]   # answered while the piped awaitable still waits
    fut.set_result(42)
    await asyncio.wait_for(_until(lambda: len(actor.got) == 2), 2)
    ref.tell("after")
    assert await ref.ask("get") == ["before", Piped(42, None), "after"]


async def test_an_exception_arrives_as_the_error_and_wrap_shapes_the_message(system):
    actor = Piper()
    ref = await system.spawn(actor, name="p")
    failing, wrapped = system.loop.create_future(), system.loop.create_future()
    ref.tell(("pipe", "a", failing))
    ref.tell(("wrapped", wrapped))
    failing.set_exception(ValueError("no"))
    wrapped.set_result("yes")
    await asyncio.wait_for(_until(lambda: len(actor.got) == 2), 2)
    got = {type(m): m for m in actor.got}
    assert got[Piped].result is None and isinstance(got[Piped].error, ValueError)
    assert got[tuple] == ("wrapped", "yes", None)
    assert ref.is_alive


async def test_stopping_the_actor_cancels_the_task_and_nothing_arrives_after(system):
    actor = Piper()
    ref = await system.spawn(actor, name="p")
    fut = system.loop.create_future()
    ref.tell(("pipe", "a", fut))
    assert await ref.ask("get") == []
    letters = system.dead_letters
    await system.stop(ref)
    assert actor.cancelled == ["a"] and actor.pipes["a"].done   # cancelled and awaited, not dangling
    assert actor.pipes_done_in_on_stop == [True]
    fut.set_result("late")
    await asyncio.sleep(0.01)
    assert actor.got == [] and system.dead_letters == letters


async def test_a_restart_cancels_a_running_pipe_and_drops_an_outcome_already_posted(system):
    actor = Piper()
    ref = await system.spawn(actor, name="p", supervision=FAST)
    running = system.loop.create_future()
    ref.tell(("pipe", "running", running))
    ref.tell(("posted", "posted", "fail"))   # its Piped is in the mailbox when the actor restarts
    ref.tell("after restart")
    assert await ref.ask("get") == ["after restart"]
    assert actor.cancelled == ["running"]
    running.set_result("stale")
    await asyncio.sleep(0.01)
    assert await ref.ask("get") == ["after restart"]   # the restarted actor sees neither outcome
    fut = system.loop.create_future()
    ref.tell(("pipe", "new", fut))
    fut.set_result("fresh")
    await asyncio.wait_for(_until(lambda: len(actor.got) == 2), 2)
    assert actor.got == ["after restart", Piped("fresh", None)]


async def test_a_pipe_cancelled_after_it_posted_is_never_received(system):
    actor = Piper()
    ref = await system.spawn(actor, name="p")
    ref.tell(("posted", "x", "cancel"))
    assert await ref.ask("get") == []
    assert await ref.ask("get") == []   # asked after the outcome was posted


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.001)
