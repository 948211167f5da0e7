"""Engine side of the index: keeps the store in step with the engine's KV manager.

When the KV manager has recorded events, `notify()` wakes the `run()` loop; it drains them and
applies them in one round trip, republishes a snapshot when the store saw a gap (or lost
track of the engine), and heartbeats while idle. It never raises into the engine: a failing
index only costs routing quality, so errors are logged and repaired by the next snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from prefix_store.events import ApplyResult, KVEvent
from prefix_store.hashing import BlockHash
from prefix_store.store import PrefixStore

log = structlog.get_logger(__name__)


class KVEventSource(Protocol):
    """What the KV manager offers the index; in an engine, the KV actor's answers to asks
    (`actors.kv.kv_actor.KVActorEvents`)."""

    async def take_events(self) -> list[KVEvent]: ...

    async def snapshot(self) -> tuple[int, list[BlockHash]]: ...


class IndexPublisher:
    def __init__(self, store: PrefixStore, engine_id: str, source: KVEventSource, *,
                 timeout_s: float = 1.0, snapshot_timeout_s: float = 30.0,
                 heartbeat_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not engine_id:
            raise ValueError("engine_id must be non-empty")
        if timeout_s <= 0 or snapshot_timeout_s <= 0:
            raise ValueError(f"timeouts must be positive, got {timeout_s}, {snapshot_timeout_s}")
        self.store = store
        self.engine_id = engine_id
        self.source = source
        self.timeout_s = timeout_s
        # A snapshot of a large cache uploads in chunks and may take seconds.
        self.snapshot_timeout_s = snapshot_timeout_s
        # Three beats per TTL: one lost beat never expires a healthy engine.
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else store.ttl_s / 3
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be positive, got {self.heartbeat_s}")
        self._clock = clock
        self._need_snapshot = True
        self._last_refresh = float("-inf")
        self._retry_at = float("-inf")  # after a failure, wait a beat before the next try
        self._wake = asyncio.Event()
        self.snapshots = 0  # how often the store had to be resynchronised (a health signal)

    async def start(self) -> None:
        """A (re)starting engine drops whatever the index still holds under its id."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):
                await self.store.clear_engine(self.engine_id)
        self._need_snapshot = True
        self._retry_at = float("-inf")
        await self.publish()

    def notify(self) -> None:
        """Events are waiting (the KV actor said so); cheap and synchronous."""
        self._wake.set()

    async def run(self) -> None:
        """Publish whenever notified, heartbeat when idle; the owner cancels it on shutdown."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat_s):
                    await self._wake.wait()
            self._wake.clear()
            await self.publish()

    async def publish(self) -> None:
        """One sync: the drained events, or a snapshot when needed, or a heartbeat when due."""
        # Drain first: a snapshot taken below, later, covers every drained event.
        try:
            async with asyncio.timeout(self.timeout_s):
                events = await self.source.take_events()
        except Exception as exc:  # whatever the KV manager drained for us is lost: resync later
            self._failed(exc)
            return
        now = self._clock()
        if self._need_snapshot and now < self._retry_at:
            return  # the coming snapshot covers the events just dropped
        if not self._need_snapshot and not events and now - self._last_refresh < self.heartbeat_s:
            return
        try:
            if not self._need_snapshot:
                async with asyncio.timeout(self.timeout_s):
                    self._need_snapshot = not await self._send(events)
            if self._need_snapshot:
                async with asyncio.timeout(self.snapshot_timeout_s):
                    next_seq, hashes = await self.source.snapshot()
                    await self.store.publish_snapshot(self.engine_id, hashes, next_seq)
                self._need_snapshot = False
                self.snapshots += 1
            self._last_refresh = self._clock()
        except Exception as exc:  # the drained events are lost: resync with a snapshot later
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self._need_snapshot = True
        self._retry_at = self._clock() + self.heartbeat_s
        log.warning("prefix index publish failed", engine_id=self.engine_id, error=repr(exc))

    async def _send(self, events: list[KVEvent]) -> bool:
        """Events, or a heartbeat without them; False when the store lost track of us."""
        if events:
            return await self.store.apply_events(self.engine_id, events) is ApplyResult.APPLIED
        return await self.store.heartbeat(self.engine_id)

    async def stop(self) -> None:
        """Graceful shutdown: take this engine out of routing at once rather than at expiry."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):
                await self.store.clear_engine(self.engine_id)
