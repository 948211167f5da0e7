"""Waiting in a test for what a collector actor has received."""
from __future__ import annotations

import asyncio
from typing import Callable


async def wait_until(changed: asyncio.Event, pred: Callable[[], bool], timeout: float = 60.0) -> None:
    """Until `pred()` holds, looked at again each time `changed` is set; TimeoutError after `timeout`."""
    async def loop():
        while not pred():
            changed.clear()
            await changed.wait()
    await asyncio.wait_for(loop(), timeout)
