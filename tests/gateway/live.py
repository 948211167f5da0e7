"""A real gateway on loopback for tests: its own event loop in a thread, one engine, several apps.

The apps share the engine (each with its own receiver) so limits such as a tiny queue or a fast
ping interval get their own gateway without loading the model twice.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading

from aiohttp import web

from actors.config import EngineConfig
from actors.messages.front_end import GetStats, ListLoRAAdapters, LoadLoRAAdapter, UnloadLoRAAdapter
from gateway.app import create_app, server_options
from gateway.app_keys import STATE
from gateway.config import GatewayConfig
from gateway.embedded import engine_handle
from runtime import Actor


class SchedulerProxy(Actor):
    """Forwards to the real scheduler; stopping it looks, to a gateway, like the engine dying."""

    def __init__(self, target) -> None:
        self.target = target

    async def receive(self, msg):
        if isinstance(msg, (GetStats, ListLoRAAdapters, LoadLoRAAdapter, UnloadLoRAAdapter)):
            return await self.target.ask(msg)
        self.target.tell(msg)


class LiveServer:
    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runners: list[web.AppRunner] = []
        self.engine = None

    def run(self, coro, timeout: float = 300.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self.thread.start()
        from actors.engine import start_engine
        self.engine = self.run(start_engine(self.engine_config))

    def spawn_proxy(self, name: str):
        return self.run(self.engine.system.spawn(SchedulerProxy(self.engine.scheduler), name=name))

    def stop_actor(self, ref) -> None:
        self.run(self.engine.system.stop(ref))

    def add_app(self, config: GatewayConfig, ready: bool = True, scheduler=None, setup=None) -> str:
        """Serve a gateway on a free port; returns its base URL. `ready=False`: no engine ever;
        `scheduler`: reach the engine through this ref instead of its own scheduler; `setup(app)`
        runs before it starts."""
        async def shared(system):
            handle = engine_handle(self.engine)
            return dataclasses.replace(handle, close=None, scheduler=scheduler or handle.scheduler)

        async def never(system):
            await asyncio.Event().wait()

        async def go() -> str:
            app = create_app(config, shared if ready else never)
            if setup is not None:
                setup(app)
            runner = web.AppRunner(app, **{**server_options(config), "shutdown_timeout": 2.0})
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            if ready:
                await asyncio.wait_for(app[STATE].ready_event.wait(), 60)
            port = site._server.sockets[0].getsockname()[1]
            return f"http://127.0.0.1:{port}"

        return self.run(go())

    def stop(self) -> None:
        async def go():
            for r in self.runners:
                await r.cleanup()
            if self.engine is not None:
                await self.engine.stop()

        try:
            self.run(go(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
