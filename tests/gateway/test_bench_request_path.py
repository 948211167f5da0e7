"""bench/request_path.py's counter on a tiny path of actors: a message told to an actor, computed on
another thread, its result told on; and the step length it reports."""
import asyncio
import inspect
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from bench import request_path
from bench.request_path import PathCounter
from runtime import Actor, ActorSystem


def compute(ref, n: int) -> int:
    """The "forward": two project calls inside (LocalRef's properties); long enough that its result
    comes back from the thread, not found done."""
    time.sleep(0.05)
    return n + ref.is_alive + len(ref.path)


def delivered(n: int) -> None:
    """Where the path ends."""


class Relay(Actor):
    def __init__(self, to, executor) -> None:
        self.to, self.executor = to, executor

    async def receive(self, msg) -> None:
        self.to.tell(await asyncio.get_running_loop().run_in_executor(self.executor, compute, self.to, msg))


class Sink(Actor):
    def __init__(self) -> None:
        self.got = asyncio.Event()

    async def receive(self, msg) -> None:
        delivered(msg)
        self.got.set()


async def request(relay) -> None:
    """Where the path starts."""
    relay.tell(1)


async def tiny_path(counter: PathCounter) -> None:
    system = ActorSystem("bench-test")
    await system.start()
    executor = ThreadPoolExecutor(1)
    try:
        sink_actor = Sink()
        sink = await system.spawn(sink_actor, name="sink")
        relay = await system.spawn(Relay(sink, executor), name="relay")
        sys.setprofile(counter)
        try:
            await request(relay)
            await asyncio.wait_for(sink_actor.got.wait(), 10)
        finally:
            sys.setprofile(None)
    finally:
        executor.shutdown()
        await system.shutdown()


def run(counter: PathCounter) -> None:
    loop = asyncio.SelectorEventLoop()   # the standard loop, whose call_soon_threadsafe a profiler sees
    threading.setprofile(counter)   # the executor's thread starts inside
    try:
        loop.run_until_complete(tiny_path(counter))
    finally:
        threading.setprofile(None)
        loop.close()


def test_counts_the_hops_and_calls_of_a_tiny_path():
    counter = PathCounter(request.__code__, delivered.__code__, forward=(compute.__code__,))
    run(counter)   # not armed: nothing counted
    assert not counter.done and counter.calls == [] and counter.hops == []
    counter.arm()
    run(counter)
    assert counter.done
    out = counter.summary(top=3)
    assert out["path"][0] == "mailbox: relay <- int" and out["path"][-1] == "mailbox: sink <- int"
    assert out["hops_by_kind"] == {"mailbox": 2, "thread": 2} and out["queue_puts"] == 0   # thread: submit, back
    assert out["hops"] == 4
    assert out["path"][1] == "thread: ThreadPoolExecutor <- compute" and out["path"][2].startswith("thread: loop <- ")
    # runtime's own calls (the puts) are counted; the two inside compute only in `calls`
    assert out["calls_outside_forward"] > 0 and out["calls"] - out["calls_outside_forward"] == 2
    assert 0 < out["distinct_functions"] <= out["calls"]
    assert out["coroutine_resumes"] > 0   # the drain loops waking are resumptions, not calls
    assert any(k.endswith(" ActorCell.put") for k in out["most_called_outside_forward"])


def test_step_lines_is_the_step_functions_length():
    from actors.scheduler.scheduler_actor import SchedulerActor

    lines, _ = inspect.getsourcelines(SchedulerActor.step)
    assert request_path.step_lines() == len(lines) > 10
