"""Turns: a coroutine that holds its actor's mailbox in its turns and lets it flow while it awaits;
it resumes in mailbox order, and a stop or a restart cancels it for good."""
import asyncio

from runtime import Actor, Supervision

FAST = Supervision(max_restarts=5, window_s=10.0, backoff_initial_s=0.001, backoff_max_s=0.01)


class Stepper(Actor):
    """`("run", fut, then)`: a coroutine that logs its turns, awaits `fut` away from them, then does
    `then` in its second turn; every other message is logged as it is handled."""

    def __init__(self):
        self.log: list = []
        self.turns = None
        self.cancelled: list[str] = []
        self.done_in_on_stop: list[bool] = []

    async def on_stop(self):
        self.done_in_on_stop.append(self.turns.done if self.turns is not None else None)

    async def receive(self, msg):
        match msg:
            case ("run", fut, then):
                self.turns = self.context.run_in_turns(lambda turns: self._run(turns, fut, then))
                await self.turns.first_turn()
                self.log.append("handler back")
            case ("fail first turn",):
                self.turns = self.context.run_in_turns(self._fail_at_once)
                await self.turns.first_turn()
            case ("boom",):
                raise RuntimeError("restart")
            case "get":
                return list(self.log)
            case _:
                self.log.append(msg)

    async def _run(self, turns, fut, then):
        self.log.append("turn 1")
        await asyncio.sleep(0.01)   # still its turn: nothing else is handled meanwhile
        self.log.append("turn 1 end")
        try:
            got = await turns.reenter_after(self._away(fut))
        except ValueError as e:
            got = f"raised {e}"
        self.log.append(("turn 2", got))
        if then == "fail":
            raise RuntimeError("a later turn fails the actor")

    async def _away(self, fut):
        try:
            return await asyncio.shield(fut)   # the test resolves it later
        except asyncio.CancelledError:
            self.cancelled.append("away")
            raise

    async def _fail_at_once(self, turns):
        raise KeyError("in the first turn")


async def test_the_first_turn_holds_the_mailbox_and_the_resumption_waits_its_turn(system):
    actor = Stepper()
    ref = await system.spawn(actor, name="s")
    fut = system.loop.create_future()
    ref.tell(("run", fut, None))
    ref.tell("queued in turn 1")
    assert await ref.ask("get") == ["turn 1", "turn 1 end", "handler back", "queued in turn 1"]
    ref.tell("while away")
    fut.set_result(7)
    ref.tell("after its result")   # in the mailbox before the resumption can be
    await asyncio.wait_for(_until(lambda: len(actor.log) == 7), 2)
    assert actor.log[4:] == ["while away", "after its result", ("turn 2", 7)]
    assert actor.turns.done and not actor.turns.away


async def test_the_awaitables_exception_is_raised_in_the_next_turn(system):
    actor = Stepper()
    ref = await system.spawn(actor, name="s")
    fut = system.loop.create_future()
    ref.tell(("run", fut, None))
    fut.set_exception(ValueError("no"))
    await asyncio.wait_for(_until(lambda: ("turn 2", "raised no") in actor.log), 2)
    assert ref.is_alive


async def test_the_first_turns_exception_goes_to_the_caller(system):
    actor = Stepper()
    ref = await system.spawn(actor, name="s")
    try:
        await ref.ask(("fail first turn",))
    except KeyError:
        pass
    else:
        raise AssertionError("the asker did not get the first turn's exception")
    assert ref.is_alive and actor.done_in_on_stop == []


async def test_a_later_turns_exception_fails_the_actor(system):
    actor = Stepper()
    ref = await system.spawn(actor, name="s", supervision=FAST)
    fut = system.loop.create_future()
    ref.tell(("run", fut, "fail"))
    fut.set_result(1)
    await asyncio.wait_for(_until(lambda: actor.done_in_on_stop), 2)   # restarted: on_stop ran
    assert actor.done_in_on_stop == [True] and ("turn 2", 1) in actor.log
    ref.tell("after restart")
    assert (await ref.ask("get"))[-1] == "after restart"


async def test_stopping_the_actor_cancels_it_while_away_and_it_never_resumes(system):
    actor = Stepper()
    ref = await system.spawn(actor, name="s")
    fut = system.loop.create_future()
    ref.tell(("run", fut, None))
    await ref.ask("get")
    await system.stop(ref)
    assert actor.cancelled == ["away"] and actor.done_in_on_stop == [True]
    fut.set_result("late")
    await asyncio.sleep(0.01)
    assert ("turn 2", "late") not in actor.log


async def test_a_restart_drops_a_resumption_already_in_the_mailbox(system):
    actor = Stepper()
    ref = await system.spawn(actor, name="s", supervision=FAST)
    fut = system.loop.create_future()
    fut.set_result("ready")
    ref.tell(("run", fut, None))
    ref.tell(("boom",))   # handled (and failing) before the resumption queued behind it
    ref.tell("after restart")
    assert await ref.ask("get") == ["turn 1", "turn 1 end", "handler back", "after restart"]
    await asyncio.sleep(0.01)
    assert await ref.ask("get") == ["turn 1", "turn 1 end", "handler back", "after restart"]
    assert actor.turns.done and actor.turns.cancelled


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.001)


class Token:
    """A message kind a coroutine takes from receive while it is away."""

    def __init__(self, n):
        self.n = n


class Taker(Actor):
    """`("run", fut)`: a coroutine that awaits `fut` away from its turns, taking every Token meanwhile;
    receive logs what reaches it, Tokens included."""

    def __init__(self):
        self.log: list = []
        self.turns = None

    async def receive(self, msg):
        match msg:
            case ("run", fut):
                self.turns = self.context.run_in_turns(lambda turns: self._run(turns, fut))
                await self.turns.first_turn()
            case ("boom",):
                raise RuntimeError("restart")
            case "get":
                return list(self.log)
            case Token():
                self.log.append(("receive", msg.n))
            case _:
                self.log.append(msg)

    async def _run(self, turns, fut):
        got = await turns.reenter_after(asyncio.shield(fut), take=(Token, self._token))
        self.log.append(("resumed", got))

    async def _token(self, token):
        self.log.append(("taken", token.n))
        if token.n == "bad":
            raise ValueError("a taken message fails the actor as receive's would")


async def test_taken_messages_reach_the_coroutine_in_mailbox_order_until_it_resumes(system):
    actor = Taker()
    ref = await system.spawn(actor, name="t")
    fut = system.loop.create_future()
    ref.tell(("run", fut))
    for msg in (Token(1), "other", Token(2)):
        ref.tell(msg)
    assert await ref.ask("get") == [("taken", 1), "other", ("taken", 2)]
    ref.tell(Token(3))
    fut.set_result("done")
    ref.tell(Token(4))   # told before the resumption can queue behind it: still taken
    await asyncio.wait_for(_until(lambda: any(e[0] == "resumed" for e in actor.log if isinstance(e, tuple))), 2)
    ref.tell(Token(5))   # after the resumption: receive's again
    assert (await ref.ask("get"))[3:] == [("taken", 3), ("taken", 4), ("resumed", "done"), ("receive", 5)]


async def test_a_restart_gives_the_taken_kind_back_to_receive(system):
    actor = Taker()
    ref = await system.spawn(actor, name="t", supervision=FAST)
    fut = system.loop.create_future()
    ref.tell(("run", fut))
    ref.tell(("boom",))
    ref.tell(Token(1))
    assert await ref.ask("get") == [("receive", 1)]
    assert actor.turns.cancelled
    ref.tell(("run", fut))   # the kind can be taken again
    ref.tell(Token(2))
    assert (await ref.ask("get"))[-1] == ("taken", 2)


async def test_a_failing_taken_message_fails_the_actor(system):
    actor = Taker()
    ref = await system.spawn(actor, name="t", supervision=FAST)
    ref.tell(("run", system.loop.create_future()))
    ref.tell(Token("bad"))
    ref.tell(Token(1))
    await asyncio.wait_for(_until(lambda: ("receive", 1) in actor.log), 2)   # restarted, the kind given back
    assert actor.log == [("taken", "bad"), ("receive", 1)]
