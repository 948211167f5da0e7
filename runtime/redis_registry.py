"""Cluster registry in Redis: one key per name holding [node, path, mac], with a TTL that a
heartbeat task refreshes, so the entries of a node that dies expire by themselves.

The mac (auth.entry_mac, keyed by the cluster secret) binds node and path to the key's name;
an entry without a valid one is ignored, so whoever can write to Redis cannot add a node."""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from runtime import auth
from runtime.log import get_logger

_MAX_LOGGED = 1024   # distinct bad keys warned about, so a flood of them cannot flood the log


class RedisRegistry:
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, secret: bytes | str,
                 prefix: str = "matinee:registry:",
                 ttl_s: float = 10.0, heartbeat_s: float | None = None,
                 socket_timeout_s: float = 2.0, connect_timeout_s: float = 2.0, retries: int = 3,
                 client: Any = None):
        if not secret:
            raise ValueError("a Redis registry needs the cluster secret to sign and check entries")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else ttl_s / 3
        if not 0 < self.heartbeat_s < ttl_s:
            raise ValueError("heartbeat_s must be > 0 and shorter than ttl_s")
        self.prefix = prefix
        self._key = auth.registry_key(secret.encode() if isinstance(secret, str) else secret)
        self._logged_bad: set[str] = set()
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.redis = client or aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            health_check_interval=30,
        )
        self._owned: dict[str, bytes] = {}
        self._heartbeat: asyncio.Task | None = None
        self.log = get_logger(component="registry")

    async def register(self, name: str, node: str, path: str) -> None:
        if not name:
            raise ValueError("registry names must be non-empty")
        key = self.prefix + name
        value = msgspec.json.encode([node, path, auth.entry_mac(self._key, key, node, path).hex()])
        await self.redis.set(key, value, px=self.ttl_ms)
        self._owned[name] = value
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def unregister(self, name: str) -> None:
        self._owned.pop(name, None)
        await self.redis.delete(self.prefix + name)

    async def lookup(self, name: str) -> tuple[str, str] | None:
        key = self.prefix + name
        return self._verified(key, await self.redis.get(key))

    async def entries(self, prefix: str = "") -> dict[str, tuple[str, str]]:
        pattern = _glob_escape(self.prefix + prefix) + "*"
        keys = [k async for k in self.redis.scan_iter(match=pattern, count=500)]
        if not keys:
            return {}
        values = await self.redis.mget(keys)
        out: dict[str, tuple[str, str]] = {}
        for key, raw in zip(keys, values):
            k = key.decode() if isinstance(key, bytes) else key
            entry = self._verified(k, raw)
            if entry is not None:
                out[k[len(self.prefix):]] = entry
        return out

    def _verified(self, key: str, raw: bytes | None) -> tuple[str, str] | None:
        """(node, path) of an entry signed with the cluster secret; None for anything else."""
        if raw is None:
            return None
        try:
            node, path, mac = msgspec.json.decode(raw, type=tuple[str, str, str])
            if auth.verify(auth.entry_mac(self._key, key, node, path), bytes.fromhex(mac)):
                return node, path
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            pass
        if key not in self._logged_bad and len(self._logged_bad) < _MAX_LOGGED:
            self._logged_bad.add(key)
            self.log.warning("ignoring a registry entry that is not signed with the cluster secret", key=key)
        return None

    async def _beat(self) -> None:
        while self._owned:
            await asyncio.sleep(self.heartbeat_s)
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for name, value in self._owned.items():
                        pipe.set(self.prefix + name, value, px=self.ttl_ms)
                    await pipe.execute()
            except (RedisError, OSError) as exc:
                # Keep beating: once Redis is back, the next beat restores the entries.
                self.log.warning("registry heartbeat failed", error=repr(exc))

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            try:
                await self._heartbeat
            except asyncio.CancelledError:
                pass
            self._heartbeat = None
        await self.redis.aclose()


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)
