"""OpenAI-shaped API errors: every failure the gateway reports goes through APIError.

The body is always {"error": {"message", "type", "param", "code"}}; bad input must end here as
a 4xx, never as a 500.
"""
from __future__ import annotations

import msgspec
from aiohttp import web


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()),
                            content_type="application/json", headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


def unavailable(message: str = "No engine is ready to serve requests yet.") -> APIError:
    return APIError(503, message, type="service_unavailable", code="service_unavailable",
                    headers={"Retry-After": "1"})


def internal(message: str = "The server had an error while processing the request.") -> APIError:
    return APIError(500, message, type="internal_server_error", code="internal_error")
