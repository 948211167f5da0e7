"""Coalescing concurrent lookups: every caller gets its own answer or the batch's error."""

from __future__ import annotations

import asyncio

import pytest

from prefix_store.coalescer import Coalescer


class Doubler:
    def __init__(self, fail: bool = False, delay: float = 0.0):
        self.batches: list[list[int]] = []
        self.fail, self.delay = fail, delay

    async def __call__(self, queries: list[int]) -> list[int]:
        self.batches.append(queries)
        await asyncio.sleep(self.delay)
        if self.fail:
            raise ConnectionError("index down")
        return [2 * q for q in queries]


async def test_concurrent_calls_ride_in_one_batch_and_get_their_own_answers():
    run = Doubler()
    coalescer = Coalescer(run, max_batch=100)
    assert await asyncio.gather(*(coalescer(i) for i in range(10))) == [2 * i for i in range(10)]
    assert run.batches == [list(range(10))]
    await coalescer.close()


async def test_calls_made_during_a_batch_wait_for_the_next_and_batches_are_capped():
    gate, started = asyncio.Event(), asyncio.Event()
    batches = []

    async def gated(queries):
        batches.append(queries)
        started.set()
        await gate.wait()  # the first batch stays in flight until the later calls are queued
        return [2 * q for q in queries]

    coalescer = Coalescer(gated, max_batch=3)
    first = asyncio.gather(*(coalescer(i) for i in range(5)))
    await started.wait()
    later = asyncio.gather(*(coalescer(i) for i in range(5, 7)))
    await asyncio.sleep(0)
    gate.set()
    assert await first == [0, 2, 4, 6, 8]
    assert await later == [10, 12]
    assert batches == [[0, 1, 2], [3, 4, 5], [6]]
    await coalescer.close()


async def test_a_failing_batch_fails_each_of_its_callers_and_the_next_batch_runs():
    run = Doubler(fail=True)
    coalescer = Coalescer(run)
    results = await asyncio.gather(*(coalescer(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)
    run.fail = False
    assert await coalescer(4) == 8
    await coalescer.close()


async def test_a_caller_that_gives_up_leaves_the_others_their_answers():
    run = Doubler(delay=0.05)
    coalescer = Coalescer(run)

    async def impatient():
        async with asyncio.timeout(0.01):
            return await coalescer(1)

    results = await asyncio.gather(impatient(), coalescer(2), return_exceptions=True)
    assert isinstance(results[0], TimeoutError)
    assert results[1] == 4
    await coalescer.close()


async def test_close_cancels_what_is_in_flight():
    coalescer = Coalescer(Doubler(delay=10))
    call = asyncio.ensure_future(coalescer(1))
    await asyncio.sleep(0.01)
    await coalescer.close()
    with pytest.raises(asyncio.CancelledError):
        await call
