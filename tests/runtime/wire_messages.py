"""Messages the runtime's cross-process tests exchange (registered on import in both processes)."""
import msgspec

from runtime import ActorRef, register_messages


class RtEcho(msgspec.Struct, tag=True):
    value: int


class RtSeq(msgspec.Struct, tag=True, array_like=True):
    sender: int
    n: int


class RtForward(msgspec.Struct, tag=True):
    """Ask the far actor to tell `value` to `reply_to` (a ref that crossed the wire)."""
    value: int
    reply_to: ActorRef


class RtFail(msgspec.Struct, tag=True):
    text: str


class RtSleep(msgspec.Struct, tag=True):
    seconds: float


class RtGetSeen(msgspec.Struct, tag=True):
    pass


class RtPlain(msgspec.Struct, tag=True):
    """Reply with a plain msgpack value rather than a Struct."""


class RtStop(msgspec.Struct, tag=True):
    pass


register_messages(RtEcho, RtSeq, RtForward, RtFail, RtSleep, RtGetSeen, RtPlain, RtStop)
