"""The tenant of the request being handled: its API key, for a server-side prefix-cache salt.

A middleware records the API key (a bearer token, or Anthropic's `x-api-key` header) in a context
variable for the handler's task; the engine client (one engine or a cluster's pool) salts that
request's block hashes with it, so tenants never share cached prompt blocks, nor learn from
`cached_tokens` what another tenant sent.
"""
from __future__ import annotations

from contextvars import ContextVar

from aiohttp import web

from prefix_store import TenantSalts

current_api_key: ContextVar[str | None] = ContextVar("current_api_key", default=None)


def api_key_of(request: web.Request) -> str:
    """The key a client sent: `Authorization: Bearer KEY` (OpenAI's SDK), else `x-api-key: KEY`
    (Anthropic's); '' when neither. The auth check and the tenant salt read it the same way."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key", "").strip()


@web.middleware
async def tenant_middleware(request: web.Request, handler):
    token = current_api_key.set(api_key_of(request) or None)
    try:
        return await handler(request)
    finally:
        current_api_key.reset(token)


def current_cache_salt(salts: TenantSalts | None, request_salt: str | None = None) -> str | None:
    """The cache salt of the request being handled: its tenant's (None without an API key),
    joined with the request's own `cache_salt` when it sends one. A tenant's salt is hex, so the
    '/' keeps every (tenant, request salt) pair apart from every other and from a tenant alone."""
    tenant = salts.salt_for(current_api_key.get()) if salts is not None else None
    if request_salt is None:
        return tenant
    return f"{tenant or ''}/{request_salt}"
