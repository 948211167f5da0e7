"""The event loop: uvloop when it is installed, the standard asyncio loop otherwise."""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

try:
    import uvloop
except ImportError:   # optional: e.g. Windows
    uvloop = None


def new_event_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """asyncio.run on uvloop where available."""
    if not hasattr(asyncio, "Runner"):   # Python 3.10
        if uvloop is not None:
            uvloop.install()
        return asyncio.run(main, debug=debug)
    with asyncio.Runner(loop_factory=new_event_loop, debug=debug) as runner:
        return runner.run(main)


def using_uvloop() -> bool:
    return uvloop is not None and isinstance(asyncio.get_running_loop(), uvloop.Loop)
