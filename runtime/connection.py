"""One authenticated TCP connection between two nodes, as an asyncio Protocol: handshake,
then sealed records (seal.py) carrying frames, parsed many per read and dispatched; the write
side is outbox.py. Anything malformed closes this connection (with a logged reason), never the
node; a record that fails authentication is dropped and the connection goes on."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec

from runtime import auth, protocol, seal
from runtime.codec import (HANDSHAKE_MAX_BYTES, HEADER, Auth, Challenge, Codec, Died, ErrorReply,
                           Ping, ReplyAny, Unwatch, Watch, Welcome)
from runtime.errors import ActorDead, AskTimeout, RemoteError
from runtime.outbox import Outbox
from runtime.ref import Ask

if TYPE_CHECKING:
    from runtime.remoting import Remoting

_LOCAL_ERRORS = {"ActorDead": ActorDead, "AskTimeout": AskTimeout}


class RemoteReply:
    """Future-like reply slot for an ask that came over this connection."""

    __slots__ = ("conn", "id", "_done")

    def __init__(self, conn: Connection, id: int):
        self.conn = conn
        self.id = id
        self._done = False

    def done(self) -> bool:
        return self._done or self.conn.closed

    def set_result(self, value: Any) -> None:
        self._done = True
        self.conn.send_reply(self.id, value)

    def set_exception(self, exc: BaseException) -> None:
        self._done = True
        self.conn.send_frame(ErrorReply(self.id, type(exc).__name__, str(exc)))


class Connection(asyncio.Protocol):
    def __init__(self, remoting: Remoting, dialed: str | None = None):
        self.remoting = remoting
        system = remoting.system
        self.system = system
        self.loop = system.loop
        self.log = remoting.log
        self.outbound = dialed is not None
        self.peer: str | None = dialed
        self.cells = system._cells
        self.codec = Codec(system.ref_for)
        self.cap = system.max_frame_bytes
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.was_open = False   # authenticated at some point (a failed dial never was)
        self.closed = False
        self.rx = bytearray()
        self.pending: dict[int, asyncio.Future] = {}
        self.remote_watched: set[str] = set()
        self.ready: asyncio.Future = self.loop.create_future()
        self.ready.add_done_callback(_consume)
        self._nonce = b""
        self._peer_nonce = b""
        self._peer_announced = ""
        self.opener: seal.Opener | None = None
        self._rejected = 0
        self._last_rx = self.loop.time()
        self._timer: asyncio.TimerHandle | None = None
        ob = self.outbox = Outbox(self.loop, self.codec, self.cap)
        # The write side's methods, bound once: refs call these on every message.
        self.send_frame = ob.send_frame
        self.send_prefixed = ob.send_prefixed
        self.send_tell = ob.send_tell
        self.send_ask = ob.send_ask
        self.send_reply = ob.send_reply
        self.tell_prefix = ob.tell_prefix
        self._bind_frames()

    def _bind_frames(self) -> None:
        self.codec.refresh()
        self._bound_version = self.codec.version
        fs = self.codec.frames
        self._tells = tuple(fs.tell_classes)
        self._batch_cls = fs.batch
        self._handlers = {ReplyAny: self._on_reply, ErrorReply: self._on_error, Watch: self._on_watch,
                          Unwatch: self._on_unwatch, Died: self._on_died, Ping: _ignore}
        for cls in fs.ask_classes:
            self._handlers[cls] = self._on_ask
        for cls in fs.reply_classes:
            self._handlers[cls] = self._on_reply

    # ---- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.closed:   # accepted while the node shuts down
            transport.abort()
            return
        self._last_rx = self.loop.time()
        self._timer = self.loop.call_later(self.system.connect_timeout_s, self._handshake_expired)
        if not self.outbound:
            self._nonce = auth.new_nonce()
            self._write_handshake(Challenge(self.system.address, self._nonce))

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if not self.open:
            data = self._handshake_received(data)   # what follows the handshake is sealed
            if not data:
                return
        try:
            data = self.opener.open(data)
        except seal.RecordTooLarge as exc:
            self.abort(str(exc))
            return
        if self.opener.rejected != self._rejected:
            self._on_rejected()
        if not data:
            return
        self._last_rx = self.loop.time()   # only authenticated bytes prove the peer alive
        if self._bound_version != protocol.version:
            self._bind_frames()
        if self.rx:
            self.rx += data
            used = self._parse(self.rx)
            del self.rx[:used]
        else:
            used = self._parse(data)
            if used < len(data):
                self.rx += data[used:]

    def connection_lost(self, exc: Exception | None) -> None:
        self._shut(f"connection lost: {exc}" if exc else "connection closed by peer")

    # ---- reading -------------------------------------------------------------------------
    def _handshake_received(self, data: bytes) -> bytes:
        """Handshake frames (plaintext, small); returns the bytes after the one that opened."""
        rx = self.rx
        rx += data
        n = len(rx)
        pos = 0
        try:
            while not self.open and n - pos >= 4:
                size = HEADER.unpack_from(rx, pos)[0]
                if size > HANDSHAKE_MAX_BYTES:
                    self.abort(f"handshake frame of {size} bytes exceeds the cap")
                    return b""
                end = pos + 4 + size
                if end > n:
                    break
                self._on_handshake(self.codec.handshake_decoder.decode(rx[pos + 4:end]))
                pos = end
                if self.closed:
                    return b""
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.abort(f"bad handshake frame: {exc}")
            return b""
        rest = bytes(rx[pos:]) if self.open else b""
        del rx[:n if self.open else pos]
        return rest

    def _on_rejected(self) -> None:
        if not self._rejected:
            self.log.warning("dropping records that fail authentication", peer=self.peer)
        self.system.rejected_records += self.opener.rejected - self._rejected
        self._rejected = self.opener.rejected

    def _parse(self, data: bytes | bytearray) -> int:
        n = len(data)
        pos = 0
        mv = memoryview(data)
        cells = self.cells
        tells = self._tells
        batch = self._batch_cls
        try:
            while n - pos >= 4:
                size = HEADER.unpack_from(data, pos)[0]
                if size > self.cap:
                    self.abort(f"frame of {size} bytes exceeds the cap")
                    return n
                end = pos + 4 + size
                if end > n:
                    break
                frame = self.codec.decoder.decode(mv[pos + 4:end])
                pos = end
                if frame.__class__ is batch:
                    # Runs of tells to one actor: append to its mailbox, wake it once.
                    last_to = None
                    cell = append = None
                    for f in frame.items:
                        if f.to != last_to:
                            if cell is not None:
                                cell.notify()
                            last_to = f.to
                            cell = cells.get(last_to)
                            if cell is not None and cell.dead:
                                cell = None
                            append = cell.dq.append if cell is not None else None
                        if append is not None:
                            append(f.msg)
                        else:
                            self.system.dead_letters += 1
                    if cell is not None:
                        cell.notify()
                elif frame.__class__ in tells:
                    cell = cells.get(frame.to)
                    if cell is not None:
                        cell.put(frame.msg)
                    else:
                        self.system.dead_letters += 1
                else:
                    self._handlers[frame.__class__](frame)
                    if self.closed:
                        return n
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.abort(f"bad frame: {exc}")
            return n
        except Exception as exc:
            self.log.error("error handling a frame", peer=self.peer, exc_info=exc)
            self.abort(f"error handling a frame: {exc!r}")
            return n
        return pos

    def _on_handshake(self, frame: Any) -> None:
        secret = self.system.secret
        me = self.system.address
        if self.outbound and type(frame) is Challenge and not self._nonce:
            self._peer_announced = frame.node
            self._peer_nonce = frame.nonce
            self._nonce = auth.new_nonce()
            self._write_handshake(Auth(me, auth.client_proof(secret, frame.nonce, me), self._nonce))
        elif self.outbound and type(frame) is Welcome and self._nonce:
            if not auth.verify(auth.server_proof(secret, self._nonce, self._peer_announced), frame.mac):
                self.abort("peer failed to prove the cluster secret")
                return
            to_server, to_client = auth.session_keys(secret, self._peer_nonce, self._nonce)
            self._opened(to_server, to_client)
        elif not self.outbound and type(frame) is Auth:
            if not auth.verify(auth.client_proof(secret, self._nonce, frame.node), frame.mac):
                self.abort("wrong secret")
                return
            self.peer = frame.node
            self._write_handshake(Welcome(auth.server_proof(secret, frame.nonce, me)))
            to_server, to_client = auth.session_keys(secret, self._nonce, frame.nonce)
            self._opened(to_client, to_server)
        else:
            self.abort(f"unexpected handshake frame {type(frame).__name__}")

    def _opened(self, send_key: bytes, receive_key: bytes) -> None:
        self.opener = seal.Opener(receive_key)
        self.outbox.transport = seal.Sealer(send_key, self.transport)
        self.open = True
        self.was_open = True
        self.outbox.open = True
        self._last_rx = self.loop.time()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.system.heartbeat_s, self._heartbeat)
        if not self.outbound:
            self.remoting.adopt(self)
        if not self.ready.done():
            self.ready.set_result(None)
        self.outbox.flush()

    def _on_ask(self, frame: Any) -> None:
        cell = self.cells.get(frame.to)
        if cell is None:
            self.send_frame(ErrorReply(frame.id, "ActorDead", f"no actor {frame.to!r} on {self.system.address}"))
        else:
            cell.put(Ask(frame.msg, RemoteReply(self, frame.id)))

    def _on_reply(self, frame: Any) -> None:
        fut = self.pending.pop(frame.id, None)
        if fut is not None and not fut.done():
            fut.set_result(frame.value)

    def _on_error(self, frame: ErrorReply) -> None:
        fut = self.pending.pop(frame.id, None)
        if fut is not None and not fut.done():
            local = _LOCAL_ERRORS.get(frame.error)
            fut.set_exception(local(frame.message) if local else RemoteError(frame.error, frame.message))

    def _on_watch(self, frame: Watch) -> None:
        cell = self.cells.get(frame.path)
        if cell is None or cell.dead:
            self.send_frame(Died(frame.path))
            return
        self.remote_watched.add(frame.path)
        cell.watchers[(self, frame.path)] = lambda _t, path=frame.path: self._send_died(path)

    def _send_died(self, path: str) -> None:
        self.remote_watched.discard(path)
        if not self.closed:
            self.send_frame(Died(path))

    def _on_unwatch(self, frame: Unwatch) -> None:
        self.remote_watched.discard(frame.path)
        cell = self.cells.get(frame.path)
        if cell is not None:
            cell.watchers.pop((self, frame.path), None)

    def _on_died(self, frame: Died) -> None:
        if self.peer is not None:
            self.remoting.on_died(self.peer, frame.path)

    # ---- writing -------------------------------------------------------------------------
    def _write_handshake(self, frame: Any) -> None:
        buf = bytearray()
        self.codec.write(buf, frame)
        self.transport.write(bytes(buf))

    # ---- liveness and closing ------------------------------------------------------------
    def _heartbeat(self) -> None:
        if self.closed:
            return
        hb = self.system.heartbeat_s
        if self.loop.time() - self._last_rx > 3 * hb:
            self.abort("peer unresponsive")
            return
        self.send_frame(Ping())
        self._timer = self.loop.call_later(hb, self._heartbeat)

    def _handshake_expired(self) -> None:
        if not self.open:
            self.abort("handshake timed out")

    def abort(self, reason: str) -> None:
        """Drop this connection at once; the node keeps serving its others."""
        if not self.closed:
            self.log.warning("closing connection", peer=self.peer, reason=reason)
        if self.transport is not None:
            self.transport.abort()
        self._shut(reason)

    def close(self, reason: str) -> None:
        """Flush what is buffered, then close."""
        if self.transport is not None and not self.closed:
            self.outbox.flush_final()
            self.transport.close()
        self._shut(reason)

    def _shut(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.open = False
        self.outbox.closed = True
        self.outbox.open = False
        self.outbox.out = bytearray()
        if self._timer is not None:
            self._timer.cancel()
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"{self.peer or 'peer'}: {reason}"))
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ActorDead(f"node {self.peer} unreachable ({reason})"))
        for path in self.remote_watched:
            cell = self.cells.get(path)
            if cell is not None:
                cell.watchers.pop((self, path), None)
        self.remote_watched.clear()
        self.remoting.on_lost(self, reason)


def _ignore(frame: Any) -> None:
    pass


def _consume(fut: asyncio.Future) -> None:
    # A failed dial nobody awaited is not an "exception never retrieved".
    if not fut.cancelled():
        fut.exception()
