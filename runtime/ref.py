"""Actor references: the only way to reach an actor, local or remote, with one interface.

A ref may be a field of a msgspec message; the transport turns it into (node, path) on the wire."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable

from runtime.errors import ActorDead, AskTimeout

if TYPE_CHECKING:
    from runtime.cell import ActorCell
    from runtime.remoting import Remoting

DEFAULT_ASK_TIMEOUT_S = 5.0


class Ask:
    """Mailbox item for a message sent by ask(); `reply` is a future or anything future-like."""

    __slots__ = ("msg", "reply")

    def __init__(self, msg: Any, reply: Any):
        self.msg = msg
        self.reply = reply


def _expire(fut: asyncio.Future, path: str, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(AskTimeout(f"no reply from {path!r} within {timeout}s"))


class ActorRef:
    """Address of an actor. `tell` never blocks; `ask` awaits the handler's return value."""

    __slots__ = ()

    @property
    def path(self) -> str:
        raise NotImplementedError

    @property
    def node(self) -> str:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self.path.rpartition("/")[2]

    def tell(self, msg: Any) -> None:
        raise NotImplementedError

    async def ask(self, msg: Any, timeout: float | None = DEFAULT_ASK_TIMEOUT_S) -> Any:
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        """Best knowledge without a round trip: False once the actor is known to be dead."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.node}/{self.path}>"


class LocalRef(ActorRef):
    """Ref to an actor of this process. `tell` is the cell's put, bound once, for speed."""

    __slots__ = ("tell", "_cell")

    def __init__(self, cell: ActorCell):
        self._cell = cell
        self.tell = cell.put

    @property
    def path(self) -> str:
        return self._cell.path

    @property
    def node(self) -> str:
        return self._cell.system.address

    @property
    def is_alive(self) -> bool:
        return not self._cell.dead

    async def ask(self, msg: Any, timeout: float | None = DEFAULT_ASK_TIMEOUT_S) -> Any:
        cell = self._cell
        if cell.dead:
            raise ActorDead(f"actor {cell.path!r} is stopped")
        fut = cell.loop.create_future()
        cell.put(Ask(msg, fut))
        if timeout is None:
            return await fut
        handle = cell.loop.call_later(timeout, _expire, fut, cell.path, timeout)
        try:
            return await fut
        finally:
            handle.cancel()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalRef) and other._cell is self._cell

    def __hash__(self) -> int:
        return id(self._cell)


class _ByAddress(ActorRef):
    """A ref that is its (node, path) address, not a handle on a cell of this process."""

    __slots__ = ("_node", "_path")

    def __init__(self, node: str, path: str):
        self._node = node
        self._path = path

    @property
    def path(self) -> str:
        return self._path

    @property
    def node(self) -> str:
        return self._node


class RemoteRef(_ByAddress):
    """Ref to an actor on another node; frames go through the system's remoting layer."""

    __slots__ = ("_remoting", "_conn", "_cls", "_prefix")

    def __init__(self, remoting: Remoting, node: str, path: str):
        super().__init__(node, path)
        self._remoting = remoting
        self._conn: Any = None
        self._cls: type | None = None      # the last message class and its frame prefix
        self._prefix = b""

    @property
    def is_alive(self) -> bool:
        return self._remoting.is_reachable(self._node)

    def tell(self, msg: Any) -> None:
        conn = self._conn
        if conn is None or conn.closed:
            # Keep using one connection while it lives: that is what keeps per-sender order.
            conn = self._conn = self._remoting.conn_for(self._node)
            if conn is None:
                return
        if msg.__class__ is not self._cls:
            self._prefix = conn.tell_prefix(msg, self._path)
            self._cls = msg.__class__
        conn.send_prefixed(self._prefix, msg)

    def ask(self, msg: Any, timeout: float | None = DEFAULT_ASK_TIMEOUT_S) -> Awaitable[Any]:
        # The remoting coroutine itself, without a wrapper coroutine around it.
        return self._remoting.ask(self._node, self._path, msg, timeout)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteRef) and other._node == self._node and other._path == self._path

    def __hash__(self) -> int:
        return hash((self._node, self._path))


class DeadRef(_ByAddress):
    """Ref to an actor that no longer exists (e.g. a decoded ref to an unknown local path)."""

    __slots__ = ()

    @property
    def is_alive(self) -> bool:
        return False

    def tell(self, msg: Any) -> None:
        pass

    async def ask(self, msg: Any, timeout: float | None = DEFAULT_ASK_TIMEOUT_S) -> Any:
        raise ActorDead(f"actor {self._path!r} does not exist on {self._node}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeadRef) and other._node == self._node and other._path == self._path

    def __hash__(self) -> int:
        return hash((self._node, self._path))
