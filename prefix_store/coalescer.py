"""Coalesces concurrent lookups into batches: calls made while one batch is in flight ride
together in the next, so a burst of routing decisions costs a few round trips, not hundreds.

The batch runs in a task of its own: a caller that gives up (its deadline passed) never
cancels a command half-way through the wire, which would cost the connection it used.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Q = TypeVar("Q")
R = TypeVar("R")


class Coalescer(Generic[Q, R]):
    def __init__(self, run_batch: Callable[[list[Q]], Awaitable[list[R]]], max_batch: int = 128):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._run_batch = run_batch
        self._max_batch = max_batch
        self._pending: list[tuple[Q, asyncio.Future[R]]] = []
        self._task: asyncio.Task | None = None
        self.batches = 0  # how many batches ran (for tests and metrics)

    async def __call__(self, query: Q) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((query, future))
        if self._task is None or self._task.done():
            # Started now, it first runs on the next loop iteration: calls made in this one
            # join its first batch.
            self._task = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch = self._pending[:self._max_batch]
            del self._pending[:self._max_batch]
            batch = [(q, f) for q, f in batch if not f.done()]  # callers that gave up
            if not batch:
                continue
            self.batches += 1
            try:
                results = await self._run_batch([q for q, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"a batch of {len(batch)} lookups got {len(results)} answers")
            except asyncio.CancelledError:
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)

    async def close(self) -> None:
        """Cancel the batch in flight (its callers see CancelledError) and any waiting calls."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
