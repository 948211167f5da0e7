"""Server-sent events on an aiohttp StreamResponse: data events, ping comments, [DONE]; and
named events (`event:` lines, as the Responses and Messages APIs stream them), which end without [DONE].

Headers tell proxies not to buffer (X-Accel-Buffering) so tokens reach the client as they come.
"""
from __future__ import annotations

import msgspec
from aiohttp import web

_encode = msgspec.json.Encoder().encode

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
    "Connection": "keep-alive",
}


class SSEWriter:
    def __init__(self) -> None:
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)

    async def open(self, request: web.Request) -> None:
        await self.response.prepare(request)

    async def send(self, *events: dict) -> None:
        """Several events in one write: fewer syscalls when deltas arrive together."""
        await self.response.write(b"".join(b"data: " + _encode(e) + b"\n\n" for e in events))

    async def send_named(self, *events: tuple[str, dict]) -> None:
        """(name, data) events, each with its `event:` line, in one write."""
        await self.response.write(b"".join(b"event: " + name.encode() + b"\ndata: " + _encode(e) + b"\n\n"
                                           for name, e in events))

    async def ping(self) -> None:
        await self.response.write(b": ping\n\n")

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.end()

    async def end(self) -> None:
        """The end of a stream whose last event says it is the last (no [DONE])."""
        await self.response.write_eof()

    async def fail(self, error) -> None:
        """An error after the headers went out: its event, then [DONE], as vLLM ends such streams."""
        await self.send(error.body())
        await self.done()
