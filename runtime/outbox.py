"""The write side of one connection: frames appended to one buffer, flushed once per loop iteration.

Tells sent in one iteration are packed into one TellBatch frame as they are sent (a cached
[tag, to] prefix plus the message encoded in place), so size errors still reach the sender."""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from runtime import protocol
from runtime.codec import BATCH_HEAD, COUNT_OFFSET, HEADER, Codec, ErrorReply, ReplyAny

FLUSH_NOW_BYTES = 1 << 20
_pack_header = HEADER.pack_into
_NO_LENGTH = b"\0\0\0\0"   # patched once the frame is encoded


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop, codec: Codec, cap: int):
        self.loop = loop
        self.codec = codec
        self.cap = cap
        self.transport: asyncio.Transport | None = None
        self.open = False      # frames are held until the handshake is done
        self.closed = False
        self.out = bytearray()
        self.flush_scheduled = False
        self._encode = codec.encoder.encode
        self._encode_into = codec.encoder.encode_into
        self._tell_prefix: dict[tuple[type, str], bytes] = {}
        self._batch = -1        # offset of the open TellBatch frame in self.out, -1 when none
        self._batch_n = 0
        self._item_cap = cap - 16
        self._batch_cap = min(cap // 2, 256 * 1024)

    def send_frame(self, frame: Any) -> None:
        """Asks, replies and control frames: written at once (they wait on a round trip) unless
        this iteration's tells are already waiting for the flush, which keeps them in order."""
        if self.closed:
            return
        if self._batch >= 0:
            self._close_batch()
        out = self.out
        start = len(out)
        out += _NO_LENGTH
        try:
            self._encode_into(frame, out, start + 4)
        except BaseException:
            del out[start:]
            raise
        size = len(out) - start - 4
        if size > self.cap:
            del out[start:]
            raise ValueError(f"message of {size} bytes exceeds the frame cap of {self.cap}")
        _pack_header(out, start, size)
        if self.open and (not self.flush_scheduled or len(out) >= FLUSH_NOW_BYTES):
            self.out = bytearray()
            self.transport.write(out)

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
            self.loop.call_soon(self.flush)
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
            cls = getattr(self.codec.frames, table).get(type(msg))
        if cls is None:
            raise TypeError(f"{type(msg).__name__} is not a registered message type "
                            "(runtime.register_messages) and cannot cross processes")
        return cls

    def send_ask(self, path: str, id: int, msg: Any) -> None:
        cls = self.codec.frames.ask.get(msg.__class__)
        if cls is None:
            cls = self.frame_class("ask", msg)
        self.send_frame(cls(path, id, msg))

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

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.open:
            self._close_batch()
            data, self.out = self.out, bytearray()
            self.transport.write(data)

    def flush_final(self) -> None:
        """Write whatever is buffered before the transport closes."""
        if self.out and self.open and self.transport is not None:
            self._close_batch()
            self.transport.write(bytes(self.out))
        self.out = bytearray()
