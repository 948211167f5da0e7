"""Every HTTP request's id and its access-log line.

The id is the client's `X-Request-Id` when it sends a usable one, else a new one; it is bound on
every log line written while the request is handled and sent back on every response (errors and
streams included). One `http request` line per request tells method, path, status and duration.
"""
from __future__ import annotations

import re
import time
import uuid

from aiohttp import web

from runtime import bound, get_logger

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = web.RequestKey("request_id", str)              # the id of this HTTP request
CLIENT_REQUEST_ID = web.RequestKey("client_request_id", bool)   # whether the client chose it
# What a client's id may be: printable, no spaces, short enough for a log line.
USABLE_ID = re.compile(r"[\x21-\x7e]{1,128}")
_CLIENT_GONE = 499   # nginx's status for a request whose client went away before the response

log = get_logger(component="gateway")


def request_id(request: web.Request) -> str:
    return request[REQUEST_ID]


def request_log_middleware(access_log: bool):
    @web.middleware
    async def request_log(request: web.Request, handler):
        given = request.headers.get(REQUEST_ID_HEADER, "")
        client_chose = bool(USABLE_ID.fullmatch(given))
        rid = given if client_chose else uuid.uuid4().hex
        request[REQUEST_ID], request[CLIENT_REQUEST_ID] = rid, client_chose
        start = time.monotonic()
        status = _CLIENT_GONE
        with bound(request_id=rid):
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as e:   # redirects and the like, which aiohttp answers itself
                status = e.status
                raise
            finally:   # also when the client went away (cancelled): logged as 499
                if access_log:
                    log.info("http request", method=request.method, path=request.path, status=status,
                             duration_ms=round((time.monotonic() - start) * 1000, 1),
                             remote=request.remote)

    return request_log


async def send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the id on every response, also one a middleware or aiohttp made."""
    rid = request.get(REQUEST_ID)
    if rid is not None:
        response.headers[REQUEST_ID_HEADER] = rid
