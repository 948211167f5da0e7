"""A relay that does not know the cluster secret sits between two nodes on loopback TCP: it
forwards the handshake untouched, then injects forged frames and replays records. The traffic
still arrives exactly as sent, nothing injected is delivered, and the relay reads nothing."""
import asyncio
import contextlib

import msgspec

from runtime import Actor, ActorSystem, register_messages, seal
from runtime.codec import HEADER, ReplyAny, current_frames
from tests.runtime.relay import TO_CLIENT, TO_SERVER, Relay
from tests.runtime.wire_messages import RtEcho

SECRET = "relay-test-secret"
PAYLOAD = "tangerine-kestrel-payload"


class RelayNote(msgspec.Struct, tag=True):
    n: int
    text: str


register_messages(RelayNote)


class Far(Actor):
    def __init__(self):
        self.notes: list[RelayNote] = []
        self.changed = asyncio.Event()

    async def receive(self, msg):
        match msg:
            case RtEcho(value=v):
                return RtEcho(v + 1)
            case RelayNote():
                self.notes.append(msg)
                self.changed.set()


def frame(obj) -> bytes:
    payload = msgspec.msgpack.encode(obj)
    return HEADER.pack(len(payload)) + payload


class Attacker:
    """Once the handshake is through: a forged tell and a replay towards the server, and forged
    replies for every ask id plus a replay towards the client. Each would be obeyed in plaintext."""

    def __init__(self):
        self.injected = {TO_SERVER: 0, TO_CLIENT: 0}
        self.previous = b""

    def __call__(self, direction: str, index: int, chunk: bytes) -> list[bytes]:
        out = [chunk]
        if direction == TO_SERVER and index == 2:
            tell = current_frames()[1].tell[RelayNote]
            out = [frame(tell("far", RelayNote(-1, "INJECTED"))), chunk, chunk]
        elif direction == TO_CLIENT and index == 4:
            out = [*(frame(ReplyAny(i, "FORGED")) for i in range(1, 200)), chunk, self.previous]
        if len(out) > 1:
            self.injected[direction] += 1
        if direction == TO_CLIENT:
            self.previous = chunk
        return out


@contextlib.asynccontextmanager
async def through_relay(tamper=None):
    """A far node that advertises the relay's address, and a near node that reaches it there."""
    relay = Relay(tamper)
    port = await relay.start()
    far = ActorSystem("far", listen=0, secret=SECRET, advertise=f"127.0.0.1:{port}")
    near = ActorSystem("near", secret=SECRET)
    await far.start()
    await near.start()
    relay.upstream = far.remoting.server.sockets[0].getsockname()[:2]
    try:
        actor = Far()
        await far.spawn(actor, name="far")
        yield relay, far, near, actor, near.remote_ref(far.address, "far")
    finally:
        await near.shutdown()
        await far.shutdown()
        await relay.close()


async def test_a_relay_without_the_secret_learns_nothing_and_changes_nothing():
    attacker = Attacker()
    async with through_relay(attacker) as (relay, far, near, actor, ref):
        for i in range(20):
            assert await ref.ask(RtEcho(i), timeout=5) == RtEcho(i + 1)
            ref.tell(RelayNote(i, PAYLOAD))
        while len(actor.notes) < 20:
            actor.changed.clear()
            await asyncio.wait_for(actor.changed.wait(), 5)
        assert await ref.ask(RtEcho(100), timeout=5) == RtEcho(101)   # after whatever was injected
        assert actor.notes == [RelayNote(i, PAYLOAD) for i in range(20)]
        assert relay.connections == 1 and attacker.injected == {TO_SERVER: 1, TO_CLIENT: 1}
        assert far.rejected_records >= 2 and near.rejected_records >= 2
        assert PAYLOAD.encode() not in relay.captured


async def test_a_frame_larger_than_a_record_crosses_in_several():
    async with through_relay() as (relay, _, _, actor, ref):
        text = PAYLOAD * (3 * seal.RECORD_PLAIN_MAX // len(PAYLOAD))
        ref.tell(RelayNote(1, text))
        assert await ref.ask(RtEcho(1), timeout=10) == RtEcho(2)
        assert actor.notes == [RelayNote(1, text)]
        assert len(relay.captured) > 3 * seal.RECORD_PLAIN_MAX and PAYLOAD.encode() not in relay.captured
