"""A man in the middle for the wire tests: a TCP proxy that does not know the cluster secret,
keeps every byte it forwards, and may inject, replay or drop the length-prefixed chunks it sees
(handshake frames, then whatever follows them) on the way, or cut the connection partway."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

from runtime.codec import HEADER

TO_SERVER, TO_CLIENT = "to_server", "to_client"
# tamper(direction, index of the chunk in that direction, chunk) -> the chunks to send instead
Tamper = Callable[[str, int, bytes], list[bytes]]


class Cut(Exception):
    """Raised by a tamper: `head` (part of a chunk, say) still goes on, then the connection closes."""

    def __init__(self, head: bytes = b""):
        super().__init__("cut")
        self.head = head


class Relay:
    def __init__(self, tamper: Tamper | None = None):
        self.tamper = tamper
        self.upstream: tuple[str, int] | None = None
        self.captured = bytearray()
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        await asyncio.gather(self._pipe(reader, up_writer, TO_SERVER), self._pipe(up_reader, writer, TO_CLIENT))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        index = 0
        try:
            while True:
                head = await reader.readexactly(4)
                chunk = head + await reader.readexactly(HEADER.unpack(head)[0])
                self.captured += chunk
                writer.write(b"".join(self.tamper(direction, index, chunk)) if self.tamper else chunk)
                index += 1
        except Cut as cut:
            writer.write(cut.head)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
