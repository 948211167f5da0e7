"""Wire frames between nodes and the per-connection msgspec codec that writes and reads them.

Frame types are rebuilt whenever the registered message set changes: msgspec unions may not mix
array-like and map-like Structs, so each frame kind exists once per layout."""
from __future__ import annotations

import struct
from typing import Any, Callable, Union

import msgspec

from runtime import protocol
from runtime.ref import ActorRef

HEADER = struct.Struct(">I")
# A TellBatch frame opens with: length, msgpack [tag "b", array32 of items]; both counts are
# patched when the batch closes. COUNT_OFFSET locates the item count inside it.
BATCH_HEAD = b"\0\0\0\0\x92\xa1b\xdd\0\0\0\0"
COUNT_OFFSET = 8
HANDSHAKE_MAX_BYTES = 4096


class Challenge(msgspec.Struct, tag="hc", array_like=True):
    node: str
    nonce: bytes


class Auth(msgspec.Struct, tag="ha", array_like=True):
    node: str
    mac: bytes
    nonce: bytes


class Welcome(msgspec.Struct, tag="hw", array_like=True):
    mac: bytes


Handshake = Union[Challenge, Auth, Welcome]


class ReplyAny(msgspec.Struct, tag="rv", array_like=True, gc=False):
    id: int
    value: Any


class ErrorReply(msgspec.Struct, tag="e", array_like=True):
    id: int
    error: str      # the exception's type name
    message: str


class Watch(msgspec.Struct, tag="w", array_like=True):
    path: str


class Unwatch(msgspec.Struct, tag="u", array_like=True):
    path: str


class Died(msgspec.Struct, tag="d", array_like=True):
    path: str


class Ping(msgspec.Struct, tag="p", array_like=True):
    pass


class FrameSet:
    """The frame classes for one version of the registered message set."""

    def __init__(self, types: tuple[type, ...]):
        self.tell: dict[type, type] = {}
        self.ask: dict[type, type] = {}
        self.reply: dict[type, type] = {}
        self.tell_classes: list[type] = []
        self.ask_classes: list[type] = []
        self.reply_classes: list[type] = []
        frames: list[type] = [ReplyAny, ErrorReply, Watch, Unwatch, Died, Ping]
        for suffix, array_like in (("m", False), ("a", True)):
            group = tuple(t for t in types if t.__struct_config__.array_like == array_like)
            if not group:
                continue
            msg_t = Union[group]   # type: ignore[valid-type]
            tell = msgspec.defstruct(f"Tell{suffix}", [("to", str), ("msg", msg_t)],
                                     tag=f"t{suffix}", array_like=True, gc=False)
            ask = msgspec.defstruct(f"Ask{suffix}", [("to", str), ("id", int), ("msg", msg_t)],
                                    tag=f"a{suffix}", array_like=True, gc=False)
            reply = msgspec.defstruct(f"Reply{suffix}", [("id", int), ("value", msg_t)],
                                      tag=f"r{suffix}", array_like=True, gc=False)
            for t in group:
                self.tell[t], self.ask[t], self.reply[t] = tell, ask, reply
            self.tell_classes.append(tell)
            self.ask_classes.append(ask)
            self.reply_classes.append(reply)
            frames += [tell, ask, reply]
        # Tells sent in one loop iteration travel as one batch frame: one decode call for all.
        self.batch = msgspec.defstruct("TellBatch", [("items", list[Union[tuple(self.tell_classes)]])],
                                       tag="b", array_like=True, gc=False)
        frames.append(self.batch)
        self.union = Union[tuple(frames)]   # type: ignore[valid-type]


_framesets: dict[int, FrameSet] = {}


def current_frames() -> tuple[int, FrameSet]:
    version = protocol.version
    fs = _framesets.get(version)
    if fs is None:
        fs = _framesets[version] = FrameSet(protocol.registered())
    return version, fs


def make_enc_hook() -> Callable[[Any], Any]:
    def enc_hook(obj: Any) -> Any:
        if isinstance(obj, ActorRef):
            return (obj.node, obj.path)
        raise NotImplementedError(f"cannot encode {type(obj).__name__}")
    return enc_hook


def make_dec_hook(ref_for: Callable[[str, str], ActorRef]) -> Callable[[type, Any], Any]:
    """Refs decode to refs bound to the receiving node (local when they point at it)."""
    def dec_hook(tp: type, obj: Any) -> Any:
        if isinstance(tp, type) and issubclass(tp, ActorRef):
            if (type(obj) is list and len(obj) == 2 and type(obj[0]) is str
                    and type(obj[1]) is str):
                return ref_for(obj[0], obj[1])
            raise ValueError("an ActorRef is encoded as [node, path]")
        raise NotImplementedError(f"cannot decode {tp!r}")
    return dec_hook


class Codec:
    """One connection's Encoder/Decoder pair, reused for every frame."""

    def __init__(self, ref_for: Callable[[str, str], ActorRef]):
        self._dec_hook = make_dec_hook(ref_for)
        self.encoder = msgspec.msgpack.Encoder(enc_hook=make_enc_hook())
        self.handshake_decoder = msgspec.msgpack.Decoder(Handshake)
        self.version = -1
        self.frames: FrameSet | None = None
        self.decoder: msgspec.msgpack.Decoder | None = None
        self.refresh()

    def refresh(self) -> None:
        version, frames = current_frames()
        if version != self.version:
            self.version, self.frames = version, frames
            self.decoder = msgspec.msgpack.Decoder(frames.union, dec_hook=self._dec_hook)

    def write(self, out: bytearray, frame: Any) -> int:
        """Append one length-prefixed frame to `out`; returns the payload size."""
        start = len(out)
        out += b"\0\0\0\0"
        try:
            self.encoder.encode_into(frame, out, start + 4)
        except BaseException:
            del out[start:]
            raise
        size = len(out) - start - 4
        HEADER.pack_into(out, start, size)
        return size
