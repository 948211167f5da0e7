"""ActorSystem: one node. Spawns and names actors, routes to remote nodes, shuts down in order.

A root-level failure past the restart limit ends the node with exit code 1 (`terminated`)."""
from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any

from runtime.cell import ActorCell
from runtime.log import get_logger
from runtime.messages import Terminated
from runtime.ref import ActorRef, DeadRef, LocalRef, RemoteRef
from runtime.registry import Registry
from runtime.supervision import Supervision

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


class ActorSystem:
    """`listen=(host, port)` accepts other nodes (port 0: any free port); `secret` is the
    cluster secret every connection proves; `registry` publishes name -> ref entries."""

    def __init__(self, name: str = "matinee", *, listen: tuple[str, int] | int | None = None,
                 secret: bytes | str | None = None, registry: Registry | None = None,
                 advertise: str | None = None, supervision: Supervision | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 connect_timeout_s: float = 5.0, heartbeat_s: float = 2.0):
        if not name or "/" in name:
            raise ValueError(f"invalid system name {name!r}")
        if max_frame_bytes < 1024:
            raise ValueError("max_frame_bytes must be >= 1024")
        if isinstance(listen, int):
            listen = ("127.0.0.1", listen)
        if listen is not None and secret is None:
            raise ValueError("a listening node needs a cluster secret")
        self.name = name
        self.listen = listen
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.registry = registry
        self.advertise = advertise
        self.supervision = supervision or Supervision()
        self.max_frame_bytes = max_frame_bytes
        self.connect_timeout_s = connect_timeout_s
        self.heartbeat_s = heartbeat_s
        # Not dialable until listening: peers reach such a node over the connection it opened.
        self.address = f"~{name}-{uuid.uuid4().hex[:8]}"
        self.log = get_logger(node=name)
        self.exit_code: int | None = None
        self.dead_letters = 0   # messages that found no live actor (counted, not logged: hot path)
        self.rejected_records = 0   # received records that failed authentication (forged or replayed)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.remoting: Any = None
        self._cells: dict[str, ActorCell] = {}
        self._top: dict[str, ActorCell] = {}
        self._tasks: set[asyncio.Task] = set()
        self._counter = itertools.count(1)
        self._published: set[str] = set()
        self._started = False
        self._closing = False
        self._terminated: asyncio.Future | None = None
        self._fatal_task: asyncio.Task | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self.loop = asyncio.get_running_loop()
        self._terminated = self.loop.create_future()
        self._started = True
        if self.secret is not None:
            from runtime.remoting import Remoting
            self.remoting = Remoting(self)
            if self.listen is not None:
                host, port = await self.remoting.start_server(*self.listen)
                self.address = self.advertise or f"{host}:{port}"
                self.log = self.log.bind(address=self.address)
        self.log.debug("actor system started", address=self.address)

    @property
    def terminated(self) -> asyncio.Future:
        """Resolves with the node's exit code once shutdown completed (1 after a root failure)."""
        if self._terminated is None:
            raise RuntimeError("the actor system is not started")
        return self._terminated

    async def __aenter__(self) -> ActorSystem:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    async def shutdown(self, timeout: float = 10.0) -> int:
        """Stop every actor (children before parents, last spawned first), fail pending asks,
        close connections and registry entries. Returns the exit code."""
        if not self._started:
            return self.exit_code or 0
        if self._closing:
            return await asyncio.shield(self._terminated)
        self._closing = True
        deadline = self.loop.time() + timeout
        try:
            if self.registry is not None:
                for name in list(self._published):
                    await self._quiet(self.registry.unregister(name), 1.0)
                self._published.clear()
            for cell in reversed(list(self._top.values())):
                left = max(0.0, deadline - self.loop.time())
                try:
                    await asyncio.wait_for(asyncio.shield(cell.request_stop()), left)
                except asyncio.TimeoutError:
                    self.log.error("actor did not stop in time; cancelling", actor=cell.path)
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(list(self._tasks))
            if self.remoting is not None:
                await self.remoting.close()
            if self.registry is not None:
                await self._quiet(self.registry.close(), 2.0)
        finally:
            if self.exit_code is None:
                self.exit_code = 0
            if not self._terminated.done():
                self._terminated.set_result(self.exit_code)
        return self.exit_code

    async def _quiet(self, coro: Any, timeout: float) -> None:
        try:
            await asyncio.wait_for(coro, timeout)
        except Exception as exc:
            self.log.warning("registry call failed during shutdown", error=repr(exc))

    def request_shutdown(self, exit_code: int | None = None) -> None:
        """Start shutdown without waiting for it (from inside an actor, or a signal handler:
        awaiting shutdown() there would wait on the very actor that awaits it)."""
        if exit_code is not None and self.exit_code is None:
            self.exit_code = exit_code
        if not self._closing and self._fatal_task is None:
            self._fatal_task = self.loop.create_task(self.shutdown())

    def _root_failed(self, path: str, exc: BaseException) -> None:
        self.log.critical("top-level actor failed past its restart limit; stopping the node",
                          failed_actor=path, error=repr(exc))
        self.exit_code = 1
        self.request_shutdown()

    # ---- actors --------------------------------------------------------------------------
    async def spawn(self, actor: Any, name: str | None = None, *,
                    supervision: Supervision | None = None) -> ActorRef:
        """Start a top-level actor; `actor` is an Actor instance or a zero-argument factory
        (a factory gives each restart a fresh instance). Returns once on_start has run."""
        await self.start()
        return await self._spawn(None, actor, name, supervision)

    async def _spawn(self, parent: ActorCell | None, actor: Any, name: str | None,
                     supervision: Supervision | None) -> ActorRef:
        if self._closing:
            raise RuntimeError("the actor system is shutting down")
        if name is None:
            name = f"${next(self._counter)}"
        elif not name or "/" in name:
            raise ValueError(f"invalid actor name {name!r}")
        path = name if parent is None else f"{parent.path}/{name}"
        if path in self._cells:
            raise ValueError(f"an actor named {path!r} already exists")
        cell = ActorCell(self, parent, actor, path, supervision or self.supervision)
        self._cells[path] = cell
        (self._top if parent is None else parent.children)[name] = cell
        task = self.loop.create_task(cell.run(), name=f"actor:{path}")
        cell.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await cell.started
        return cell.ref

    async def stop(self, ref: ActorRef) -> None:
        """Stop a local actor and wait until it (and its children) are gone."""
        if isinstance(ref, LocalRef):
            await asyncio.shield(ref._cell.request_stop())
        else:
            raise ValueError("only local actors can be stopped from here")

    def tell_threadsafe(self, ref: ActorRef, msg: Any) -> None:
        """tell() from another thread (e.g. a compute thread); tell itself is loop-only."""
        self.loop.call_soon_threadsafe(ref.tell, msg)

    def lookup(self, path: str) -> ActorRef | None:
        cell = self._cells.get(path)
        return cell.ref if cell is not None else None

    def _on_cell_dead(self, cell: ActorCell) -> None:
        if self._cells.get(cell.path) is cell:
            del self._cells[cell.path]
        if cell.parent is None and self._top.get(cell.path) is cell:
            del self._top[cell.path]
        for ref in list(cell.watching):
            self._unwatch(cell, ref)

    # ---- death watch ---------------------------------------------------------------------
    def _watch(self, watcher: ActorCell, ref: ActorRef) -> None:
        watcher.watching.add(ref)
        if isinstance(ref, LocalRef):
            target = ref._cell
            if target.dead:
                watcher.put(Terminated(ref))
            else:
                target.watchers[watcher] = watcher.put
        elif isinstance(ref, RemoteRef):
            self.remoting.watch(ref, watcher)
        else:
            watcher.put(Terminated(ref))

    def _unwatch(self, watcher: ActorCell, ref: ActorRef) -> None:
        watcher.watching.discard(ref)
        if isinstance(ref, LocalRef):
            ref._cell.watchers.pop(watcher, None)
        elif isinstance(ref, RemoteRef) and self.remoting is not None:
            self.remoting.unwatch(ref, watcher)

    # ---- remote --------------------------------------------------------------------------
    def ref_for(self, node: str, path: str) -> ActorRef:
        """A ref to actor `path` on node `node` (this node's own address gives a local ref)."""
        if node == self.address:
            cell = self._cells.get(path)
            return cell.ref if cell is not None else DeadRef(node, path)
        if self.remoting is None:
            raise RuntimeError("this node has no cluster secret, so it cannot reach other nodes")
        return RemoteRef(self.remoting, node, path)

    def remote_ref(self, address: str, path: str) -> ActorRef:
        """A ref to actor `path` on the node listening at `address` ("host:port"); no round trip."""
        return self.ref_for(address, path)

    async def connect(self, address: str) -> None:
        """Open (and authenticate) the connection to a node now; raises ConnectionError."""
        if self.remoting is None:
            raise RuntimeError("this node has no cluster secret, so it cannot reach other nodes")
        await self.remoting.connect(address)

    # ---- registry ------------------------------------------------------------------------
    async def publish(self, name: str, ref: ActorRef) -> None:
        """Publish `name -> ref` in the registry (kept alive by the registry's heartbeat)."""
        if self.registry is None:
            raise RuntimeError("no registry configured")
        await self.registry.register(name, ref.node, ref.path)
        self._published.add(name)

    async def unpublish(self, name: str) -> None:
        if self.registry is None:
            raise RuntimeError("no registry configured")
        self._published.discard(name)
        await self.registry.unregister(name)

    async def resolve(self, name: str) -> ActorRef | None:
        """Look a published name up in the registry; None when absent or expired."""
        if self.registry is None:
            raise RuntimeError("no registry configured")
        entry = await self.registry.lookup(name)
        if entry is None:
            return None
        return self.ref_for(*entry)

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM start a graceful shutdown (Unix only)."""
        import signal
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self.request_shutdown)

