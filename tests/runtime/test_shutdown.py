"""Graceful shutdown: children stop before parents, pending asks fail, no task is left behind."""
import asyncio

import pytest

from runtime import Actor, ActorDead, ActorSystem


class Node(Actor):
    def __init__(self, log: list, depth: int):
        self.log = log
        self.depth = depth

    async def on_start(self):
        if self.depth:
            await self.context.spawn(Node(self.log, self.depth - 1), name=f"d{self.depth - 1}")

    async def receive(self, msg):
        if msg == "hang":
            await asyncio.Event().wait()
        return self.context.self_ref.path

    async def on_stop(self):
        self.log.append(self.context.self_ref.path)


async def test_children_stop_before_parents_and_no_task_is_left():
    before = asyncio.all_tasks()
    log: list[str] = []
    s = ActorSystem("shut")
    await s.start()
    await s.spawn(Node(log, 2), name="a")
    await s.spawn(Node(log, 1), name="b")
    assert await s.shutdown() == 0
    # Last spawned first; within a tree, the deepest child first.
    assert log == ["b/d0", "b", "a/d1/d0", "a/d1", "a"]
    assert asyncio.all_tasks() == before
    assert s.lookup("a") is None


async def test_shutdown_fails_pending_asks_and_cancels_a_stuck_actor():
    before = asyncio.all_tasks()
    s = ActorSystem("stuck")
    await s.start()
    ref = await s.spawn(Node([], 0), name="x")
    stuck = asyncio.ensure_future(ref.ask("hang", timeout=None))
    queued = asyncio.ensure_future(ref.ask("path", timeout=None))
    await asyncio.sleep(0.01)
    await s.shutdown(timeout=0.2)
    with pytest.raises(ActorDead):
        await stuck
    with pytest.raises(ActorDead):
        await queued
    assert asyncio.all_tasks() == before


async def test_spawn_after_shutdown_is_refused():
    s = ActorSystem("late")
    await s.start()
    await s.shutdown()
    with pytest.raises(RuntimeError):
        await s.spawn(Node([], 0), name="x")


async def test_stopping_self_from_receive(system):
    class Once(Actor):
        async def receive(self, msg):
            self.context.stop()
            return "bye"

    ref = await system.spawn(Once(), name="once")
    assert await ref.ask("x") == "bye"
    with pytest.raises(ActorDead):
        await ref.ask("y")


async def test_an_actor_can_request_shutdown_with_an_exit_code():
    class Quitter(Actor):
        async def receive(self, msg):
            self.context.system.request_shutdown(exit_code=3)
            return "ok"

    s = ActorSystem("quit")
    await s.start()
    ref = await s.spawn(Quitter(), name="q")
    assert await ref.ask("quit") == "ok"
    assert await asyncio.wait_for(s.terminated, 5) == 3
    assert not ref.is_alive
