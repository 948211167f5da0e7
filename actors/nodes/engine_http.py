"""An engine node's own HTTP port: /metrics, this engine's alone (Prometheus scrapes every
replica, so no gateway sums engines), and /ready, 200 only while the engine is registered and
admitting requests: what a container healthcheck asks. It serves nothing else and takes no input.
"""
from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from actors.stats.engine_metrics import EngineCollector
from actors.messages.front_end import GetStats
from runtime import ActorRef

STATS_TIMEOUT_S = 2.0


def create_engine_http(scheduler: ActorRef, serving: Callable[[], bool], model_name: str,
                       engine_id: str) -> web.Application:
    collector = EngineCollector(model_name, engine_id)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    async def metrics(request: web.Request) -> web.Response:
        try:
            collector.update(await scheduler.ask(GetStats(), timeout=STATS_TIMEOUT_S))
        except Exception:   # a busy or stopping engine: its last stats, never an error page
            pass
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def ready(request: web.Request) -> web.Response:
        if serving() and scheduler.is_alive:
            return web.json_response({"status": "ready", "engine_id": engine_id})
        return web.json_response({"status": "not serving", "engine_id": engine_id}, status=503)

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/ready", ready)])
    return app


async def start_engine_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
