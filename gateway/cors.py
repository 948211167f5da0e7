"""CORS for browser clients: preflight OPTIONS answered before authentication (a browser sends no
credentials with it), and the allow-origin header on every response to an allowed origin.

As vLLM's defaults: any method, any requested header, no credentials; `*` allows every origin.
"""
from __future__ import annotations

from aiohttp import web

from gateway.errors import APIError
from gateway.request_log import REQUEST_ID_HEADER

MAX_AGE_S = 600


class CorsPolicy:
    def __init__(self, allowed_origins: list[str]) -> None:
        self.any = "*" in allowed_origins
        self.origins = frozenset(allowed_origins)

    def allows(self, origin: str) -> bool:
        return self.any or origin in self.origins

    def allow_origin(self, origin: str) -> dict[str, str]:
        if self.any:
            return {"Access-Control-Allow-Origin": "*"}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def middleware(self):
        @web.middleware
        async def preflight(request: web.Request, handler):
            origin = request.headers.get("Origin")
            if (request.method != "OPTIONS" or origin is None
                    or "Access-Control-Request-Method" not in request.headers):
                return await handler(request)
            if not self.allows(origin):
                return APIError(400, f"Origin {origin} is not allowed.", code="cors_origin_not_allowed"
                                ).response()
            headers = {**self.allow_origin(origin),
                       "Access-Control-Allow-Methods": "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT",
                       "Access-Control-Max-Age": str(MAX_AGE_S)}
            if asked := request.headers.get("Access-Control-Request-Headers"):
                headers["Access-Control-Allow-Headers"] = asked
            if not self.any:
                headers["Vary"] = "Origin"
            return web.Response(status=200, text="OK", headers=headers)

        return preflight

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or not self.allows(origin) or "Access-Control-Allow-Origin" in response.headers:
            return   # not a cross-origin call it may read, or a preflight answered above
        response.headers.update(self.allow_origin(origin))
        response.headers["Access-Control-Expose-Headers"] = REQUEST_ID_HEADER
