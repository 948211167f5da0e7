"""Death watch (local) and timers posting messages to their own actor."""
import asyncio

from runtime import Actor, Terminated


class Sink(Actor):
    def __init__(self):
        self.got: list = []
        self.event = asyncio.Event()

    async def receive(self, msg):
        match msg:
            case ("watch", ref):
                self.context.watch(ref)
            case ("unwatch", ref):
                self.context.unwatch(ref)
            case ("once", delay, m):
                return self.context.schedule_once(delay, m)
            case ("every", interval, m):
                return self.context.schedule_repeating(interval, m)
            case "get":
                return list(self.got)
            case _:
                self.got.append(msg)
                self.event.set()


class Idle(Actor):
    async def receive(self, msg):
        return msg


async def test_watch_delivers_terminated_when_the_target_stops(system):
    sink = Sink()
    w = await system.spawn(sink, name="w")
    target = await system.spawn(Idle(), name="t")
    await w.ask(("watch", target))
    await system.stop(target)
    await asyncio.wait_for(sink.event.wait(), 2)
    assert await w.ask("get") == [Terminated(target)]
    assert sink.got[0].reason == "stopped"


async def test_watching_a_dead_ref_delivers_at_once_and_unwatch_silences(system):
    sink = Sink()
    w = await system.spawn(sink, name="w")
    dead = await system.spawn(Idle(), name="dead")
    await system.stop(dead)
    await w.ask(("watch", dead))
    other = await system.spawn(Idle(), name="other")
    await w.ask(("watch", other))
    await w.ask(("unwatch", other))
    await system.stop(other)
    await asyncio.sleep(0.01)
    assert await w.ask("get") == [Terminated(dead)]


async def test_schedule_once_and_cancel(system):
    sink = Sink()
    w = await system.spawn(sink, name="w")
    await w.ask(("once", 0.01, "tick"))
    cancelled = await w.ask(("once", 0.01, "never"))
    cancelled.cancel()
    await asyncio.wait_for(sink.event.wait(), 2)
    await asyncio.sleep(0.03)
    assert await w.ask("get") == ["tick"]
    assert not cancelled.active


async def test_schedule_repeating_until_cancelled(system):
    sink = Sink()
    w = await system.spawn(sink, name="w")
    timer = await w.ask(("every", 0.005, "beat"))
    while len(sink.got) < 3:
        await asyncio.sleep(0.005)
    timer.cancel()
    n = len(await w.ask("get"))
    await asyncio.sleep(0.03)
    assert len(await w.ask("get")) == n and n >= 3


async def test_timers_die_with_their_actor(system):
    sink = Sink()
    w = await system.spawn(sink, name="w")
    timer = await w.ask(("every", 0.005, "beat"))
    await system.stop(w)
    assert not timer.active
