"""Two nodes in one process over loopback TCP: ref identity across the wire, reply encoding
rules, heartbeats that notice a frozen peer process."""
import asyncio
import signal

import msgspec
import pytest

from runtime import Actor, ActorDead, ActorRef, ActorSystem, RemoteError, Terminated, register_messages
from runtime.ref import LocalRef, RemoteRef
from tests.runtime.nodes import SECRET, start_node
from tests.runtime.wire_messages import RtEcho, RtSleep


class RtRefs(msgspec.Struct, tag=True):
    main: ActorRef
    maybe: ActorRef | None = None
    many: list[ActorRef] = []


class RtUnregisteredReply(msgspec.Struct, tag=True):
    pass


class NotOnTheWire(msgspec.Struct, tag=True):
    x: int


register_messages(RtRefs, RtUnregisteredReply)


class Mirror(Actor):
    """Returns the refs it received, so they cross the wire twice."""

    async def receive(self, msg):
        match msg:
            case RtRefs():
                self.last = msg
                return msg
            case RtUnregisteredReply():
                return NotOnTheWire(1)
            case RtEcho(value=v):
                return RtEcho(v + 1)
            case RtSleep(seconds=sec):
                await asyncio.sleep(sec)
                return "slept"


@pytest.fixture
async def pair():
    a = ActorSystem("a", listen=0, secret=SECRET)
    b = ActorSystem("b", listen=0, secret=SECRET)
    await a.start()
    await b.start()
    yield a, b
    await b.shutdown()
    await a.shutdown()


async def test_refs_cross_the_wire_and_come_back_local(pair):
    a, b = pair
    mirror_actor = Mirror()
    await b.spawn(mirror_actor, name="mirror")
    mine = await a.spawn(Mirror(), name="mine")
    other = await a.spawn(Mirror(), name="other")
    remote = a.remote_ref(b.address, "mirror")
    back = await remote.ask(RtRefs(mine, None, [mine, other]))
    # On b, a's refs are remote refs bound to b; back on a they are a's local refs again.
    seen = mirror_actor.last
    assert isinstance(seen.main, RemoteRef) and seen.main.node == a.address
    assert seen.maybe is None and [r.path for r in seen.many] == ["mine", "other"]
    assert isinstance(back.main, LocalRef) and back.main == mine and back.many == [mine, other]
    assert await seen.main.ask(RtEcho(1)) == RtEcho(2)   # b reaches a over the same link


async def test_reply_rules(pair):
    a, b = pair
    await b.spawn(Mirror(), name="mirror")
    remote = a.remote_ref(b.address, "mirror")
    with pytest.raises(RemoteError) as err:
        await remote.ask(RtUnregisteredReply())
    assert err.value.type_name == "TypeError"
    with pytest.raises(TypeError):
        await remote.ask(NotOnTheWire(1))
    assert await remote.ask(RtEcho(1)) == RtEcho(2)


async def test_unknown_local_path_decodes_to_a_dead_ref(pair):
    a, b = pair
    with pytest.raises(ActorDead):   # the far node answers that no such actor exists
        await b.ref_for(a.address, "ghost").ask(RtEcho(1))
    assert a.ref_for(a.address, "ghost").is_alive is False
    with pytest.raises(ActorDead):
        await a.ref_for(a.address, "ghost").ask(RtEcho(1))


class Watcher(Actor):
    def __init__(self):
        self.got = asyncio.Queue()

    async def receive(self, msg):
        match msg:
            case ("watch", ref):
                self.context.watch(ref)
            case Terminated():
                self.got.put_nowait(msg)


async def test_a_frozen_node_is_declared_unreachable_by_heartbeat():
    node = await start_node()
    client = ActorSystem("hb", secret=SECRET, heartbeat_s=0.1)
    await client.start()
    try:
        w = Watcher()
        me = await client.spawn(w, name="w")
        echo = client.remote_ref(node.address, "echo")
        assert await echo.ask(RtEcho(1)) == RtEcho(2)
        await me.ask(("watch", echo))
        pending = asyncio.ensure_future(echo.ask(RtSleep(0), timeout=30))
        await asyncio.sleep(0)
        node.proc.send_signal(signal.SIGSTOP)   # alive but silent: no FIN, no RST
        note = await asyncio.wait_for(w.got.get(), 10)
        assert note == Terminated(echo, "node unreachable")
        if not pending.done() or pending.exception() is not None:
            with pytest.raises(ActorDead):
                await pending
    finally:
        node.proc.send_signal(signal.SIGCONT)
        await client.shutdown()
        await node.stop()


class RtBlob(msgspec.Struct, tag=True, array_like=True):
    n: int
    data: str


register_messages(RtBlob)


class Collector(Actor):
    def __init__(self):
        self.seen: list[int] = []

    async def receive(self, msg):
        match msg:
            case RtBlob(n=n):
                self.seen.append(n)
            case RtEcho():
                return list(self.seen)


async def test_batches_near_the_frame_cap_keep_order():
    a = ActorSystem("small-a", listen=0, secret=SECRET, max_frame_bytes=4096)
    b = ActorSystem("small-b", secret=SECRET, max_frame_bytes=4096)
    await a.start()
    await b.start()
    try:
        col = Collector()
        await a.spawn(col, name="col")
        ref = b.remote_ref(a.address, "col")
        sizes = [0, 10, 3000, 5, 4000, 2500, 2500, 1, 4050, 0] * 30
        for n, size in enumerate(sizes):
            ref.tell(RtBlob(n, "x" * size))
            if n % 7 == 0:
                await asyncio.sleep(0)
        with pytest.raises(ValueError):
            ref.tell(RtBlob(-1, "x" * 5000))
        assert await ref.ask(RtEcho(0)) == list(range(len(sizes)))
    finally:
        await b.shutdown()
        await a.shutdown()


async def test_shutdown_with_open_connections_leaves_no_task():
    before = asyncio.all_tasks()
    a = ActorSystem("ta", listen=0, secret=SECRET)
    b = ActorSystem("tb", listen=0, secret=SECRET)
    await a.start()
    await b.start()
    await a.spawn(Mirror(), name="m")
    w = Watcher()
    me = await b.spawn(w, name="w")
    remote = b.remote_ref(a.address, "m")
    await me.ask(("watch", remote))
    assert await remote.ask(RtEcho(1)) == RtEcho(2)
    pending = asyncio.ensure_future(remote.ask(RtSleep(30), timeout=None))
    await asyncio.sleep(0.05)   # the ask is in the far handler now
    await a.shutdown(timeout=0.2)
    with pytest.raises(ActorDead):
        await asyncio.wait_for(pending, 5)
    note = await asyncio.wait_for(w.got.get(), 5)
    assert note.ref == remote
    await b.shutdown()
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == before
