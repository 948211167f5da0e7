"""Name registry: `name -> (node address, actor path)` entries that nodes publish.

InMemoryRegistry serves one process; RedisRegistry (redis_registry.py) serves a cluster."""
from __future__ import annotations

from typing import Protocol


class Registry(Protocol):
    async def register(self, name: str, node: str, path: str) -> None: ...
    async def unregister(self, name: str) -> None: ...
    async def lookup(self, name: str) -> tuple[str, str] | None: ...
    async def entries(self, prefix: str = "") -> dict[str, tuple[str, str]]: ...
    async def close(self) -> None: ...


class InMemoryRegistry:
    """A dict behind the Registry interface; several systems of one process may share it."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[str, str]] = {}

    async def register(self, name: str, node: str, path: str) -> None:
        if not name:
            raise ValueError("registry names must be non-empty")
        self._entries[name] = (node, path)

    async def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    async def lookup(self, name: str) -> tuple[str, str] | None:
        return self._entries.get(name)

    async def entries(self, prefix: str = "") -> dict[str, tuple[str, str]]:
        return {k: v for k, v in self._entries.items() if k.startswith(prefix)}

    async def close(self) -> None:
        pass
