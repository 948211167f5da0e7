"""tell/ask semantics in one process: order, replies, errors, timeouts, dead actors, names."""
import asyncio

import msgspec
import pytest

from runtime import Actor, ActorDead, ActorSystem, AskTimeout


class Seq(msgspec.Struct, tag=True):
    sender: int
    n: int


class Get(msgspec.Struct, tag=True):
    pass


class Boom(msgspec.Struct, tag=True):
    text: str


class Hang(msgspec.Struct, tag=True):
    pass


class Recorder(Actor):
    def __init__(self):
        self.seen: dict[int, list[int]] = {}
        self.gate = asyncio.Event()

    async def receive(self, msg):
        match msg:
            case Seq(sender=s, n=n):
                self.seen.setdefault(s, []).append(n)
                if n % 97 == 0:
                    await asyncio.sleep(0)   # interleave with the senders
            case Get():
                return self.seen
            case Boom(text=t):
                raise KeyError(t)
            case Hang():
                await self.gate.wait()
                return "released"


async def test_order_per_sender_under_load(system):
    ref = await system.spawn(Recorder(), name="rec")

    async def sender(i: int):
        for n in range(3000):
            ref.tell(Seq(i, n))
            if n % 50 == 0:
                await asyncio.sleep(0)

    await asyncio.gather(*(sender(i) for i in range(8)))
    seen = await ref.ask(Get())
    assert sorted(seen) == list(range(8))
    for i in range(8):
        assert seen[i] == list(range(3000))


async def test_ask_returns_the_handler_value_and_error(system):
    ref = await system.spawn(Recorder(), name="rec")
    ref.tell(Seq(1, 5))
    assert await ref.ask(Get()) == {1: [5]}
    with pytest.raises(KeyError, match="nope"):
        await ref.ask(Boom("nope"))
    # The failing ask went to the asker; the actor keeps its state and serves on.
    assert await ref.ask(Get()) == {1: [5]}


async def test_ask_timeout(system):
    actor = Recorder()
    ref = await system.spawn(actor, name="rec")
    with pytest.raises(AskTimeout):
        await ref.ask(Hang(), timeout=0.05)
    actor.gate.set()
    assert await ref.ask(Get()) == {}
    assert isinstance(AskTimeout(), TimeoutError)


async def test_ask_to_stopped_actor_is_actor_dead_promptly(system):
    ref = await system.spawn(Recorder(), name="rec")
    await system.stop(ref)
    assert not ref.is_alive
    with pytest.raises(ActorDead):
        await asyncio.wait_for(ref.ask(Get(), timeout=30), 1.0)
    ref.tell(Seq(0, 0))   # a tell to a dead actor is dropped, never raises


async def test_queued_asks_fail_when_the_actor_stops(system):
    actor = Recorder()
    ref = await system.spawn(actor, name="rec")
    first = asyncio.ensure_future(ref.ask(Hang(), timeout=30))
    queued = asyncio.ensure_future(ref.ask(Get(), timeout=30))
    await asyncio.sleep(0.01)
    stopping = asyncio.ensure_future(system.stop(ref))
    await asyncio.sleep(0.01)
    actor.gate.set()   # the message in progress finishes; the queued one never runs
    assert await first == "released"
    with pytest.raises(ActorDead):
        await queued
    await stopping


async def test_spawn_names_lookup_and_duplicates(system):
    ref = await system.spawn(Recorder(), name="rec")
    assert system.lookup("rec") == ref
    assert ref.name == "rec" and ref.path == "rec"
    with pytest.raises(ValueError):
        await system.spawn(Recorder(), name="rec")
    with pytest.raises(ValueError):
        await system.spawn(Recorder(), name="a/b")
    anon = await system.spawn(Recorder())
    assert anon.name.startswith("$") and system.lookup(anon.path) == anon
    await system.stop(ref)
    assert system.lookup("rec") is None
    # The name is free again once its actor is gone.
    again = await system.spawn(Recorder(), name="rec")
    assert again != ref


async def test_spawn_rejects_non_actors(system):
    with pytest.raises(TypeError):
        await system.spawn(object(), name="x")


class Parent(Actor):
    async def on_start(self):
        self.child = await self.context.spawn(Recorder, name="kid")

    async def receive(self, msg):
        return self.child


async def test_children_have_paths_and_are_reachable(system):
    parent = await system.spawn(Parent(), name="p")
    child = await parent.ask("which")
    assert child.path == "p/kid" and child.name == "kid"
    assert system.lookup("p/kid") == child
    child.tell(Seq(3, 1))
    assert await child.ask(Get()) == {3: [1]}


async def test_system_context_manager_starts_and_shuts_down():
    async with ActorSystem("cm") as s:
        ref = await s.spawn(Recorder(), name="r")
        assert await ref.ask(Get()) == {}
    assert not ref.is_alive
    assert s.terminated.done() and s.terminated.result() == 0


async def test_dead_letters_are_counted(system):
    ref = await system.spawn(Recorder(), name="rec")
    await system.stop(ref)
    before = system.dead_letters
    ref.tell(Seq(0, 0))
    ref.tell(Seq(0, 1))
    assert system.dead_letters == before + 2


async def test_tell_threadsafe_from_a_thread(system):
    actor = Recorder()
    ref = await system.spawn(actor, name="rec")
    await asyncio.to_thread(lambda: [system.tell_threadsafe(ref, Seq(9, n)) for n in range(100)])
    assert (await ref.ask(Get()))[9] == list(range(100))
