"""The live dashboard: static pages from gateway/static (no build step, nothing fetched at run
time) and the server-sent stream they draw, one snapshot a second.

The pages themselves hold no data and need no key; the stream and the planner's arithmetic sit
behind --api-key like every other route. A browser cannot put a header on an EventSource, so the
pages read the stream with fetch() and send the key, typed once into the page and kept in the
tab's sessionStorage, as `Authorization: Bearer` (a key in the URL would land in access logs).
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
from aiohttp import web

from actors.stats.engine_metrics import kv_usage
from actors.messages.front_end import EngineStats
from gateway.app_keys import STATE
from gateway.sse import SSE_HEADERS

STATIC = Path(__file__).with_name("static")
INTERVAL_S = 1.0
_encode = msgspec.json.Encoder().encode
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
PAGES = {"/dashboard": "dashboard.html", "/dashboard/plan": "plan.html"}
ASSETS = ("dashboard.js", "plan.js", "chart.js", "key.js", "dashboard.css")


def engine_snapshot(s: EngineStats) -> dict:
    """One engine's gauges, cumulative counters (the page turns them into rates) and the latency
    quantiles of its last seconds, measured in the engine: from arrival at its scheduler, so
    without the gateway's tokenizing and the network that the gateway-wide figures include."""
    return {"running": s.requests_running, "waiting": s.requests_waiting, "kv_usage": kv_usage(s),
            "kv_blocks_total": s.kv_blocks_total, "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens, "prefix_queries": s.prefix_cache_queried_tokens,
            "prefix_hits": s.prefix_cache_hit_tokens, "preemptions": s.preemptions,
            "spec_draft_tokens": s.spec_decode_draft_tokens, "spec_accepted_tokens": s.spec_decode_accepted_tokens,
            "ttft_p50": s.ttft_p50, "ttft_p90": s.ttft_p90, "itl_p50": s.itl_p50, "itl_p90": s.itl_p90,
            "steps": s.steps, "batch_rows": s.ballast_rows, "batch_finished": s.ballast_finished, **_tier(s)}


def _tier(s: EngineStats) -> dict:
    """The KV tier's hits (tokens), bytes moved in and out of it, and blocks held; empty without a tier."""
    t = s.kv_tier
    if t is None:
        return {}
    return {"tier_hits": s.prefix_cache_tier_hit_tokens, "tier_blocks": t.tier_blocks,
            "tier_bytes": t.tier_bytes_saved + t.tier_bytes_loaded + t.tier_bytes_pulled}


async def snapshot(state) -> dict:
    m = state.metrics
    ttft = m.ttft.recent.quantiles(0.5, 0.9)
    itl = m.itl.recent.quantiles(0.5, 0.9)
    engines: dict = {}
    if state.client is not None and state.client.alive:
        try:
            engines = await state.client.engine_stats(timeout=2.0)
        except Exception:   # a slow engine: this tick shows none, the next one tries again
            engines = {}
    return {"t": time.time(), "model": state.model_name, "ready": state.ready,
            "ttft_p50": ttft[0], "ttft_p90": ttft[1], "itl_p50": itl[0], "itl_p90": itl[1],
            "engines": {k: engine_snapshot(v) for k, v in sorted(engines.items())}}


async def stream(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    while not state.draining:
        await response.write(b"data: " + _encode(await snapshot(state)) + b"\n\n")
        await asyncio.sleep(INTERVAL_S)
    await response.write_eof()
    return response


async def auth(request: web.Request) -> web.Response:
    """Whether the data routes want a key: the page asks for one before its first request."""
    return web.Response(body=_encode({"key_required": bool(request.app[STATE].config.api_keys)}),
                        content_type="application/json")


def _file(name: str):
    path = STATIC / name

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=path.read_bytes(), content_type=_TYPES[path.suffix], charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    return serve


ROUTES = [web.get(route, _file(name)) for route, name in PAGES.items()] + \
    [web.get(f"/dashboard/{name}", _file(name)) for name in ASSETS] + \
    [web.get("/dashboard/auth", auth), web.get("/dashboard/stream", stream)]
PUBLIC = frozenset(PAGES) | {f"/dashboard/{name}" for name in ASSETS} | {"/dashboard/auth"}
