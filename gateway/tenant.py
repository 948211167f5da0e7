"""The tenant of the request being handled: its API key, for a server-side prefix-cache salt.

A middleware records the bearer token in a context variable for the handler's task; the engine
pool salts that request's block hashes with it, so tenants never share cached prompt blocks.
"""
from __future__ import annotations

from contextvars import ContextVar

from aiohttp import web

current_api_key: ContextVar[str | None] = ContextVar("current_api_key", default=None)


@web.middleware
async def tenant_middleware(request: web.Request, handler):
    auth = request.headers.get("Authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    token = current_api_key.set(key or None)
    try:
        return await handler(request)
    finally:
        current_api_key.reset(token)
