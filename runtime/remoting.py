"""Node-to-node transport: the listener, one association (connection) per peer node, remote
ask bookkeeping, remote death watch, and redial after a dropped connection."""
from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any

from runtime.connection import Connection
from runtime.errors import ActorDead
from runtime.messages import Terminated
from runtime.ref import RemoteRef, _expire
from runtime.codec import Unwatch, Watch

if TYPE_CHECKING:
    from runtime.cell import ActorCell
    from runtime.system import ActorSystem

REDIAL_AFTER_S = 0.2


def parse_address(node: str) -> tuple[str, int] | None:
    """(host, port) for a dialable node address, None for a node that only dials out."""
    if node.startswith("~"):
        return None
    host, sep, port = node.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


class Remoting:
    def __init__(self, system: ActorSystem):
        self.system = system
        self.loop = system.loop
        self.log = system.log.bind(component="remoting")
        self.server: asyncio.AbstractServer | None = None
        self.conns: dict[str, list[Connection]] = {}     # first one carries what we send
        self.every: set[Connection] = set()
        self.watches: dict[tuple[str, str], set[ActorCell]] = {}
        self.ids = itertools.count(1)
        self.failed_at: dict[str, float] = {}
        self.dials: set[asyncio.Task] = set()
        self.closing = False

    async def start_server(self, host: str, port: int) -> tuple[str, int]:
        self.server = await self.loop.create_server(self._accept, host, port, reuse_address=True)
        bound = self.server.sockets[0].getsockname()
        return host, bound[1]

    def _accept(self) -> Connection:
        conn = Connection(self)
        if self.closing:
            conn.closed = True
        self.every.add(conn)
        return conn

    # ---- associations --------------------------------------------------------------------
    def adopt(self, conn: Connection) -> None:
        """An inbound connection authenticated: it can carry our frames to that node too."""
        self.conns.setdefault(conn.peer, []).append(conn)

    def conn_for(self, node: str) -> Connection | None:
        lst = self.conns.get(node)
        if lst:
            return lst[0]
        if self.closing:
            return None
        addr = parse_address(node)
        if addr is None:
            return None
        failed = self.failed_at.get(node)
        if failed is not None and self.loop.time() - failed < REDIAL_AFTER_S:
            return None
        conn = Connection(self, dialed=node)
        self.every.add(conn)
        self.conns[node] = [conn]
        task = self.loop.create_task(self._dial(conn, *addr))
        self.dials.add(task)
        task.add_done_callback(self.dials.discard)
        return conn

    async def _dial(self, conn: Connection, host: str, port: int) -> None:
        try:
            await asyncio.wait_for(self.loop.create_connection(lambda: conn, host, port),
                                   self.system.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            conn.abort(f"cannot connect to {host}:{port}: {exc!r}")

    def is_reachable(self, node: str) -> bool:
        if self.conns.get(node):
            return True
        failed = self.failed_at.get(node)
        return parse_address(node) is not None and (failed is None or
                                                    self.loop.time() - failed >= REDIAL_AFTER_S)

    def on_lost(self, conn: Connection, reason: str) -> None:
        self.every.discard(conn)
        node = conn.peer
        lst = self.conns.get(node) if node is not None else None
        if not lst or conn not in lst:
            return
        was_main = lst[0] is conn
        lst.remove(conn)
        if conn.outbound and not conn.was_open:
            self.failed_at[node] = self.loop.time()   # a failed dial: do not redial at once
        if lst:
            if was_main:   # the peer's watch registrations lived on the old connection
                for (n, path) in self.watches:
                    if n == node:
                        lst[0].send_frame(Watch(path))
            return
        del self.conns[node]
        if not self.closing:
            self.log.info("node unreachable", peer=node, reason=reason)
        for key in [k for k in self.watches if k[0] == node]:
            self._deliver(key, "node unreachable")

    # ---- sending -------------------------------------------------------------------------
    def send_tell(self, node: str, path: str, msg: Any) -> None:
        conn = self.conn_for(node)
        if conn is not None:
            conn.send_tell(path, msg)

    async def ask(self, node: str, path: str, msg: Any, timeout: float | None) -> Any:
        conn = self.conn_for(node)
        if conn is None:
            raise ActorDead(f"node {node} is unreachable")
        fut = self.loop.create_future()
        id = next(self.ids)
        conn.send_ask(path, id, msg)
        conn.pending[id] = fut
        if timeout is None:
            return await fut
        handle = self.loop.call_later(timeout, _expire, fut, path, timeout)
        try:
            return await fut
        finally:
            handle.cancel()
            conn.pending.pop(id, None)

    async def connect(self, node: str) -> None:
        conn = self.conn_for(node)
        if conn is None:
            raise ConnectionError(f"cannot dial {node}")
        await asyncio.shield(conn.ready)

    # ---- death watch ---------------------------------------------------------------------
    def watch(self, ref: RemoteRef, cell: ActorCell) -> None:
        key = (ref.node, ref.path)
        watchers = self.watches.setdefault(key, set())
        first = not watchers
        watchers.add(cell)
        if first:
            conn = self.conn_for(ref.node)
            if conn is None:
                self._deliver(key, "node unreachable")
            else:
                conn.send_frame(Watch(ref.path))

    def unwatch(self, ref: RemoteRef, cell: ActorCell) -> None:
        key = (ref.node, ref.path)
        watchers = self.watches.get(key)
        if watchers is None:
            return
        watchers.discard(cell)
        if not watchers:
            del self.watches[key]
            lst = self.conns.get(ref.node)
            if lst:
                lst[0].send_frame(Unwatch(ref.path))

    def on_died(self, node: str, path: str) -> None:
        self._deliver((node, path), "stopped")

    def _deliver(self, key: tuple[str, str], reason: str) -> None:
        watchers = self.watches.pop(key, ())
        if watchers:
            note = Terminated(RemoteRef(self, *key), reason)
            for cell in watchers:
                cell.watching.discard(note.ref)
                cell.put(note)

    async def close(self) -> None:
        self.closing = True
        if self.server is not None:
            self.server.close()
        for task in list(self.dials):
            task.cancel()
        for conn in list(self.every):
            conn.close("node shutting down")
        if self.dials:
            await asyncio.wait(list(self.dials))
        if self.server is not None:
            await self.server.wait_closed()
        # Let the transports run their close callbacks before the loop may end.
        await asyncio.sleep(0)
