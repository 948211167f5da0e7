"""Bad input on the wire closes only the offending connection; the node keeps serving.

Also: the listener binds loopback by default and both ends prove the cluster secret."""
import asyncio

import msgspec
import pytest

from runtime import Actor, ActorDead, ActorSystem, auth, seal
from runtime.codec import HEADER, Auth, Challenge, Welcome, current_frames
from tests.runtime.wire_messages import RtEcho

SECRET = "right-secret"


class Echo(Actor):
    async def receive(self, msg):
        return RtEcho(msg.value + 1)


@pytest.fixture
async def server():
    s = ActorSystem("server", listen=0, secret=SECRET, max_frame_bytes=4096)
    await s.start()
    await s.spawn(Echo(), name="echo")
    yield s
    await s.shutdown()


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


async def open_raw(server: ActorSystem):
    host, port = server.address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    size = HEADER.unpack(await reader.readexactly(4))[0]
    return await reader.readexactly(size)


async def authenticated(server: ActorSystem, secret: str = SECRET):
    """A raw client past the handshake, and a sealer that writes records the server accepts."""
    reader, writer = await open_raw(server)
    ch = msgspec.msgpack.decode(await read_frame(reader), type=Challenge)
    nonce = auth.new_nonce()
    me = "~raw-client"
    writer.write(frame(msgspec.msgpack.encode(Auth(me, auth.client_proof(secret.encode(), ch.nonce, me), nonce))))
    to_server, _ = auth.session_keys(secret.encode(), ch.nonce, nonce)
    return reader, writer, seal.Sealer(to_server, writer)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        while await asyncio.wait_for(reader.read(65536), 5):
            pass
        return True
    except ConnectionResetError:
        return True


async def still_serving(server: ActorSystem) -> None:
    client = ActorSystem("probe", secret=SECRET)
    await client.start()
    try:
        echo = client.remote_ref(server.address, "echo")
        assert await echo.ask(RtEcho(1), timeout=5) == RtEcho(2)
    finally:
        await client.shutdown()


async def test_listener_binds_loopback_by_default(server):
    assert server.address.startswith("127.0.0.1:")
    assert ActorSystem("x", listen=1234, secret="s").listen == ("127.0.0.1", 1234)
    with pytest.raises(ValueError):
        ActorSystem("x", listen=0)   # a listener without a secret


async def test_wrong_secret_is_refused(server):
    reader, writer, _ = await authenticated(server, secret="wrong-secret")
    assert await closed_by_server(reader)
    writer.close()
    client = ActorSystem("intruder", secret="wrong-secret")
    await client.start()
    with pytest.raises(ConnectionError):
        await client.connect(server.address)
    with pytest.raises(ActorDead):
        await client.remote_ref(server.address, "echo").ask(RtEcho(1), timeout=5)
    await client.shutdown()
    await still_serving(server)


async def test_server_proof_is_checked_by_the_client(server):
    # A fake server that does not know the secret cannot make a client talk to it.
    async def fake(reader, writer):
        writer.write(frame(msgspec.msgpack.encode(Challenge("127.0.0.1:1", auth.new_nonce()))))
        await read_frame(reader)
        writer.write(frame(msgspec.msgpack.encode(Welcome(b"\0" * 32))))
        await asyncio.sleep(1)
        writer.close()

    srv = await asyncio.start_server(fake, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    client = ActorSystem("careful", secret=SECRET)
    await client.start()
    with pytest.raises(ConnectionError):
        await client.connect(f"127.0.0.1:{port}")
    await client.shutdown()
    srv.close()
    await srv.wait_closed()


@pytest.mark.parametrize("kind", ["garbage", "oversized", "oversized_record", "unknown_type", "truncated_struct"])
async def test_bad_frames_close_only_that_connection(server, kind, capsys):
    await still_serving(server)
    reader, writer, sealed = await authenticated(server)
    await read_frame(reader)   # Welcome
    _, frames = current_frames()
    if kind == "garbage":
        sealed.write(frame(b"\xc1\xff\x00garbage"))
    elif kind == "oversized":
        sealed.write(HEADER.pack(10_000_000) + b"x" * 100)
    elif kind == "oversized_record":
        writer.write(HEADER.pack(seal.RECORD_MAX + 1) + b"x" * 100)
    elif kind == "unknown_type":
        sealed.write(frame(msgspec.msgpack.encode(["tm", "echo", {"type": "NoSuchMessage"}])))
    else:
        sealed.write(frame(msgspec.msgpack.encode(["tm", "echo"])))
    await writer.drain()
    assert await closed_by_server(reader)
    writer.close()
    err = capsys.readouterr().err
    assert "closing connection" in err and ("exceeds the cap" in err or "bad frame" in err)
    await still_serving(server)


async def test_garbage_before_auth_and_oversized_handshake(server):
    for junk in (frame(b"\x93\x01\x02\x03"), HEADER.pack(100_000)):
        reader, writer = await open_raw(server)
        await read_frame(reader)   # Challenge
        writer.write(junk)
        assert await closed_by_server(reader)
        writer.close()
    await still_serving(server)


async def test_oversized_message_is_refused_at_the_sender(server):
    client = ActorSystem("big", secret=SECRET, max_frame_bytes=4096)
    await client.start()
    try:
        echo = client.remote_ref(server.address, "echo")
        await client.connect(server.address)
        from tests.runtime.wire_messages import RtFail
        with pytest.raises(ValueError):
            echo.tell(RtFail("x" * 10_000))
        assert await echo.ask(RtEcho(3)) == RtEcho(4)
    finally:
        await client.shutdown()
