"""Supervision: one-for-one restart with backoff and a limit, escalation, root failure exit code."""
import asyncio

import pytest

from runtime import Actor, ActorSystem, Escalated, Supervision
from runtime.supervision import RestartTracker

FAST = Supervision(max_restarts=2, window_s=10.0, backoff_initial_s=0.001, backoff_max_s=0.01)


def test_restart_tracker_backoff_grows_and_limit_escalates():
    t = RestartTracker(Supervision(max_restarts=3, window_s=10, backoff_initial_s=0.1,
                                   backoff_max_s=0.3, backoff_factor=2))
    assert t.record_failure(0.0) == pytest.approx(0.1)
    assert t.record_failure(1.0) == pytest.approx(0.2)
    assert t.record_failure(2.0) == pytest.approx(0.3)   # capped
    assert t.record_failure(3.0) is None                 # fourth failure inside the window


def test_restart_tracker_window_forgets_old_failures():
    t = RestartTracker(Supervision(max_restarts=1, window_s=5, backoff_initial_s=0.1))
    assert t.record_failure(0.0) == pytest.approx(0.1)
    assert t.record_failure(6.0) == pytest.approx(0.1)
    assert t.record_failure(7.0) is None


def test_supervision_validates():
    for bad in (dict(directive="retry"), dict(max_restarts=-1), dict(window_s=0),
                dict(backoff_initial_s=2, backoff_max_s=1), dict(backoff_factor=0.5)):
        with pytest.raises(ValueError):
            Supervision(**bad)


class Flaky(Actor):
    starts = 0

    def __init__(self):
        self.state = 0

    async def on_start(self):
        Flaky.starts += 1

    async def receive(self, msg):
        match msg:
            case "fail":
                raise RuntimeError("boom")
            case "inc":
                self.state += 1
            case "get":
                return self.state


async def test_failed_tell_restarts_with_fresh_state_from_a_factory(system):
    Flaky.starts = 0
    ref = await system.spawn(Flaky, name="f", supervision=FAST)
    ref.tell("inc")
    assert await ref.ask("get") == 1
    ref.tell("fail")
    ref.tell("inc")   # queued behind the failure: survives the restart
    assert await ref.ask("get") == 1
    assert Flaky.starts == 2
    assert ref.is_alive


class Child(Actor):
    async def receive(self, msg):
        raise RuntimeError("child broke")


class Parent(Actor):
    def __init__(self, events: list):
        self.events = events

    async def on_start(self):
        self.events.append("parent start")
        self.child = await self.context.spawn(Child(), name="c", supervision=FAST)

    async def receive(self, msg):
        return self.child


async def test_restart_limit_escalates_to_the_parent(system):
    events: list[str] = []
    parent = await system.spawn(Parent(events), name="p", supervision=FAST)
    child = await parent.ask("child")
    for _ in range(3):   # two restarts allowed; the third failure escalates
        child.tell("x")
        await asyncio.sleep(0.05)
    assert events == ["parent start", "parent start"]   # the parent was restarted
    new_child = await parent.ask("child")
    assert new_child.is_alive and not child.is_alive


async def test_root_failure_past_the_limit_exits_non_zero():
    before = asyncio.all_tasks()
    s = ActorSystem("root", supervision=Supervision(max_restarts=1, backoff_initial_s=0.001))
    await s.start()
    ref = await s.spawn(Child(), name="c")
    ref.tell("x")
    ref.tell("x")
    code = await asyncio.wait_for(s.terminated, 5)
    assert code == 1 and s.exit_code == 1
    assert not ref.is_alive
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == before


async def test_escalate_directive_and_escalated_error(system):
    failures: list[BaseException] = []

    class Watcher(Actor):
        async def on_start(self):
            await self.context.spawn(Child(), name="c", supervision=Supervision(directive="escalate"))

        async def receive(self, msg):
            return None

    class Recording(Watcher):
        async def on_stop(self):
            failures.append("stopped")

    ref = await system.spawn(Recording(), name="w", supervision=Supervision(directive="stop"))
    system.lookup("w/c").tell("x")
    await asyncio.sleep(0.05)
    assert failures == ["stopped"] and not ref.is_alive
    assert issubclass(Escalated, Exception)


async def test_failing_on_start_is_retried_then_escalates():
    class BadStart(Actor):
        async def on_start(self):
            raise OSError("no weights")

    s = ActorSystem("badstart", supervision=Supervision(max_restarts=2, backoff_initial_s=0.001))
    await s.start()
    await s.spawn(BadStart(), name="b")
    assert await asyncio.wait_for(s.terminated, 5) == 1
