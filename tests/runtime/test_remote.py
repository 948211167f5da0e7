"""Two real OS processes over loopback TCP: tells, asks, refs inside messages, errors, order,
death watch, a killed node, and reconnecting to a restarted one."""
import asyncio

import pytest

from runtime import Actor, ActorDead, ActorSystem, RemoteError, Terminated
from tests.runtime.nodes import SECRET, start_node, start_node_blocking, stop_blocking
from tests.runtime.wire_messages import (RtEcho, RtFail, RtForward, RtGetSeen, RtPlain, RtSeq,
                                         RtSleep, RtStop)


class Inbox(Actor):
    def __init__(self):
        self.got: list = []
        self.changed = asyncio.Event()

    async def receive(self, msg):
        match msg:
            case ("watch", ref):
                self.context.watch(ref)
            case _:
                self.got.append(msg)
                self.changed.set()

    async def wait_for(self, n: int):
        while len(self.got) < n:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 10)
        return self.got


class SharedNode:
    def __init__(self, address: str):
        self.address = address


@pytest.fixture(scope="module")
def node():
    proc, address = start_node_blocking()
    yield SharedNode(address)
    assert stop_blocking(proc) == 0   # a graceful exit after serving every test


@pytest.fixture
async def client():
    # Not listening: the far node replies over the connection this node opened.
    s = ActorSystem("client", secret=SECRET)
    await s.start()
    yield s
    await s.shutdown()


async def test_tell_and_ask_across_processes(node, client):
    echo = client.remote_ref(node.address, "echo")
    assert await echo.ask(RtEcho(41)) == RtEcho(42)
    assert await echo.ask(RtPlain()) == {"ok": [1, 2, 3]}
    inbox = Inbox()
    me = await client.spawn(inbox, name="inbox")
    # A ref inside a message crosses the wire and comes back usable by the far node.
    assert await echo.ask(RtForward(7, me)) == "inbox"
    echo.tell(RtForward(8, me))
    assert await inbox.wait_for(2) == [RtEcho(7), RtEcho(8)]


async def test_remote_handler_error_and_unknown_actor(node, client):
    echo = client.remote_ref(node.address, "echo")
    with pytest.raises(RemoteError) as err:
        await echo.ask(RtFail("bad input"))
    assert err.value.type_name == "ValueError" and err.value.message == "bad input"
    with pytest.raises(ActorDead):
        await client.remote_ref(node.address, "nobody").ask(RtEcho(1))
    assert await echo.ask(RtEcho(1)) == RtEcho(2)   # the connection survived both


async def test_unregistered_type_is_refused_at_the_sender(node, client):
    echo = client.remote_ref(node.address, "echo")
    with pytest.raises(TypeError):
        echo.tell(("not", "a", "struct"))
    assert await echo.ask(RtEcho(1)) == RtEcho(2)


async def test_order_per_sender_over_tcp(node, client):
    echo = client.remote_ref(node.address, "echo")

    async def sender(i: int):
        for n in range(2000):
            echo.tell(RtSeq(i, n))
            if n % 100 == 0:
                await asyncio.sleep(0)

    await asyncio.gather(*(sender(i) for i in range(4)))
    seen = await echo.ask(RtGetSeen())
    assert seen == {str(i): list(range(2000)) for i in range(4)}


async def test_remote_death_watch_on_stop(node, client):
    inbox = Inbox()
    me = await client.spawn(inbox, name="inbox")
    victim = client.remote_ref(node.address, "victim")
    await me.ask(("watch", victim))
    await victim.ask(RtEcho(0))   # the Watch frame went first on the same connection
    victim.tell(RtStop())
    got = await inbox.wait_for(1)
    assert got == [Terminated(victim, "stopped")]
    with pytest.raises(ActorDead):
        await victim.ask(RtEcho(0))


async def test_killed_node_fails_pending_asks_and_notifies_watchers(client):
    node = await start_node()
    try:
        inbox = Inbox()
        me = await client.spawn(inbox, name="inbox")
        echo = client.remote_ref(node.address, "echo")
        await me.ask(("watch", echo))
        pending = asyncio.ensure_future(echo.ask(RtSleep(30), timeout=60))
        await asyncio.sleep(0.2)
        node.kill()
        with pytest.raises(ActorDead):
            await asyncio.wait_for(pending, 10)
        got = await inbox.wait_for(1)
        assert got == [Terminated(echo, "node unreachable")]
        with pytest.raises(ActorDead):
            await echo.ask(RtEcho(1), timeout=5)
    finally:
        await node.stop()


async def test_reconnects_to_a_restarted_node(client):
    node = await start_node()
    port = node.address.rpartition(":")[2]
    echo = client.remote_ref(node.address, "echo")
    assert await echo.ask(RtEcho(1)) == RtEcho(2)
    assert await node.stop() == 0
    node = await start_node("--port", port)
    try:
        for _ in range(50):   # the first tries may land inside the redial pause
            try:
                assert await echo.ask(RtEcho(5), timeout=5) == RtEcho(6)
                break
            except ActorDead:
                await asyncio.sleep(0.05)
        else:
            pytest.fail("never reconnected")
    finally:
        await node.stop()


async def test_a_node_whose_top_level_actor_fails_past_its_limit_exits_non_zero(client):
    node = await start_node()
    echo = client.remote_ref(node.address, "echo")
    assert await echo.ask(RtEcho(1)) == RtEcho(2)
    for _ in range(3):   # two restarts allowed, the third failure escalates to the root
        echo.tell(RtFail("crash"))
    assert await asyncio.wait_for(node.proc.wait(), 10) == 1
