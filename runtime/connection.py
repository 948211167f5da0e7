"""One authenticated TCP connection between two nodes, as an asyncio Protocol.

Frames are written into one buffer that is flushed once per loop iteration, and parsed many per
read. Anything malformed closes this connection (with a logged reason), never the node."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec

from runtime import auth, protocol
from runtime.codec import (BATCH_HEAD, COUNT_OFFSET, HANDSHAKE_MAX_BYTES, HEADER, Auth, Challenge, Codec, Died, ErrorReply,
                           Ping, ReplyAny, Unwatch, Watch, Welcome)
from runtime.errors import ActorDead, AskTimeout, RemoteError
from runtime.ref import Ask

if TYPE_CHECKING:
    from runtime.remoting import Remoting

FLUSH_NOW_BYTES = 1 << 20
_pack_header = HEADER.pack_into
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
        self.closed = False
        self.out = bytearray()
        self.rx = bytearray()
        self.flush_scheduled = False
        self.pending: dict[int, asyncio.Future] = {}
        self.remote_watched: set[str] = set()
        self.ready: asyncio.Future = self.loop.create_future()
        self.ready.add_done_callback(_consume)
        self._nonce = b""
        self._peer_announced = ""
        self._last_rx = self.loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._encode = self.codec.encoder.encode
        self._encode_into = self.codec.encoder.encode_into
        self._tell_prefix: dict[tuple[type, str], bytes] = {}
        self._batch = -1        # offset of the open TellBatch frame in self.out, -1 when none
        self._batch_n = 0
        self._item_cap = self.cap - 16
        self._batch_cap = min(self.cap // 2, 256 * 1024)
        self._bind_frames()

    def _bind_frames(self) -> None:
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
        self._last_rx = self.loop.time()
        if self.closed:
            return
        if self.codec.version != protocol.version:
            self.codec.refresh()
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
                if size > (self.cap if self.open else HANDSHAKE_MAX_BYTES):
                    self.abort(f"frame of {size} bytes exceeds the cap")
                    return n
                end = pos + 4 + size
                if end > n:
                    break
                if not self.open:
                    self._on_handshake(self.codec.handshake_decoder.decode(mv[pos + 4:end]))
                    pos = end
                    if self.closed:
                        return n
                    continue
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
            self._nonce = auth.new_nonce()
            self._write_handshake(Auth(me, auth.client_proof(secret, frame.nonce, me), self._nonce))
        elif self.outbound and type(frame) is Welcome and self._nonce:
            if not auth.verify(auth.server_proof(secret, self._nonce, self._peer_announced), frame.mac):
                self.abort("peer failed to prove the cluster secret")
                return
            self._opened()
        elif not self.outbound and type(frame) is Auth:
            if not auth.verify(auth.client_proof(secret, self._nonce, frame.node), frame.mac):
                self.abort("wrong secret")
                return
            self.peer = frame.node
            self._write_handshake(Welcome(auth.server_proof(secret, frame.nonce, me)))
            self._opened()
        else:
            self.abort(f"unexpected handshake frame {type(frame).__name__}")

    def _opened(self) -> None:
        self.open = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.system.heartbeat_s, self._heartbeat)
        if not self.outbound:
            self.remoting.adopt(self)
        if not self.ready.done():
            self.ready.set_result(None)
        if self.out:
            self._flush()

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

    def send_frame(self, frame: Any) -> None:
        if self.closed:
            return
        self._close_batch()
        out = self.out
        start = len(out)
        size = self.codec.write(out, frame)
        if size > self.cap:
            del out[start:]
            raise ValueError(f"message of {size} bytes exceeds the frame cap of {self.cap}")
        if self.open:
            self._written(start)

    def send_tell(self, path: str, msg: Any) -> None:
        prefix = self._tell_prefix.get((msg.__class__, path))
        if prefix is None:
            prefix = self._make_tell_prefix(msg, path)
        self.send_prefixed(prefix, msg)

    def send_prefixed(self, prefix: bytes, msg: Any) -> None:
        """The hot path: one tell appended to the open batch frame as its cached [tag, to]
        prefix plus the message encoded in place; size errors still surface at the sender."""
        if self.closed:
            return
        out = self.out
        start = len(out)
        opened = self._batch < 0
        if opened:
            self._batch = start
            self._batch_n = 0
            out += BATCH_HEAD
        item = len(out)
        out += prefix
        try:
            self._encode_into(msg, out, -1)
        except BaseException:
            self._drop_item(start if opened else item, opened)
            raise
        end = len(out)
        if end - item > self._item_cap:
            self._drop_item(start if opened else item, opened)
            raise ValueError(f"message of {end - item} bytes exceeds the frame cap of {self.cap}")
        self._batch_n += 1
        if end - self._batch > self._batch_cap:
            self._split_batch(item, end)
        if not self.flush_scheduled:
            if self.open:
                self._written(start)
        elif end >= FLUSH_NOW_BYTES and self.open:
            self._written(start)

    def _split_batch(self, item: int, end: int) -> None:
        out = self.out
        if end - self._batch - 4 > self.cap:
            # Too big to join this batch: close the batch before it and start a new one.
            data = bytes(out[item:])
            del out[item:]
            self._batch_n -= 1
            self._close_batch()
            self._batch = len(out)
            self._batch_n = 1
            out += BATCH_HEAD
            out += data
        self._close_batch()

    def _drop_item(self, cut: int, opened: bool) -> None:
        del self.out[cut:]
        if opened:
            self._batch = -1

    def _close_batch(self) -> None:
        b = self._batch
        if b >= 0:
            out = self.out
            _pack_header(out, b, len(out) - b - 4)
            _pack_header(out, b + COUNT_OFFSET, self._batch_n)
            self._batch = -1

    def tell_prefix(self, msg: Any, path: str) -> bytes:
        prefix = self._tell_prefix.get((msg.__class__, path))
        return prefix if prefix is not None else self._make_tell_prefix(msg, path)

    def _make_tell_prefix(self, msg: Any, path: str) -> bytes:
        cls = self.frame_class("tell", msg)
        # A tell item is the msgpack array [tag, to, msg]; the message is encoded after this.
        head = b"\x93" + self._encode(cls.__struct_config__.tag) + self._encode(path)
        if len(self._tell_prefix) > 10_000:
            self._tell_prefix.clear()
        self._tell_prefix[(msg.__class__, path)] = head
        return head

    def _written(self, start: int) -> None:
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)
            if start == 0:
                # Nothing else is waiting: write through now for latency; whatever else this
                # loop iteration sends is batched into the scheduled flush.
                self._close_batch()
                data, self.out = self.out, bytearray()
                self.transport.write(data)
        elif len(self.out) >= FLUSH_NOW_BYTES:
            self._close_batch()
            data, self.out = self.out, bytearray()
            self.transport.write(data)

    def frame_class(self, table: str, msg: Any) -> type:
        cls = getattr(self.codec.frames, table).get(type(msg))
        if cls is None and self.codec.version != protocol.version:
            self.codec.refresh()
            self._bind_frames()
            cls = getattr(self.codec.frames, table).get(type(msg))
        if cls is None:
            raise TypeError(f"{type(msg).__name__} is not a registered message type "
                            "(runtime.register_messages) and cannot cross processes")
        return cls

    def send_ask(self, path: str, id: int, msg: Any) -> None:
        self.send_frame(self.frame_class("ask", msg)(path, id, msg))

    def send_reply(self, id: int, value: Any) -> None:
        cls = self.codec.frames.reply.get(type(value))
        try:
            if cls is not None:
                self.send_frame(cls(id, value))
            elif isinstance(value, msgspec.Struct):
                self.send_frame(ErrorReply(id, "TypeError", f"reply type {type(value).__name__} is not registered"))
            else:
                self.send_frame(ReplyAny(id, value))
        except (TypeError, ValueError, OverflowError) as exc:
            self.send_frame(ErrorReply(id, type(exc).__name__, f"cannot send the reply: {exc}"))

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.open:
            self._close_batch()
            data, self.out = self.out, bytearray()
            self.transport.write(data)

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
            if self.out and self.open:
                self._close_batch()
                self.transport.write(bytes(self.out))
            self.transport.close()
        self._shut(reason)

    def _shut(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.open = False
        self.out = bytearray()
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
