"""The batch store of a cluster: files, batch objects and finished lines in the cluster's Redis, so
every gateway answers for every batch, and a batch outlives the gateway that ran it.

    NS:files, NS:batches     the ids of the files and batches
    NS:file:ID, :ID:data     a file object (JSON) and its bytes, both expiring at its `expires_at`
    NS:batch:ID              a batch record as last saved by the gateway running it
    NS:results:ID            its finished lines: a hash, line index -> record, each set once
    NS:counts:ID             its `completed` and `failed` lines, counted as they are set
    NS:lease:ID              the gateway running it (a token), expiring unless renewed
    NS:cancel:ID             set by any gateway asked to cancel it; its runner sees and obeys

A line is recorded, and the batch saved, only by the holder of its lease (one Lua script checks
and writes), so a gateway that lost a batch to another records nothing more, and a line's index is
set once however many gateways computed it: none answered twice, none lost.
"""
from __future__ import annotations

import os
import socket

import msgspec
import redis.asyncio as aioredis

from gateway.batch_store import LeaseLost, now

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode

# KEYS: lease, target; ARGV: token, value. The value is written only while the token holds the lease.
_SAVE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""
# KEYS: lease, results, counts; ARGV: token, index, record, 'completed' or 'failed'.
_APPEND = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
return 1
"""
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


class RedisBatchStore:
    def __init__(self, client: aioredis.Redis, namespace: str = "matinee:batch", lease_s: float = 30.0) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.redis, self.ns, self.lease_s = client, namespace, lease_s
        self._owner = f"{socket.gethostname()}:{os.getpid()}"   # in each lease token, for operators
        self._save = client.register_script(_SAVE)
        self._append = client.register_script(_APPEND)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    @classmethod
    def from_url(cls, url: str, namespace: str = "matinee:batch", lease_s: float = 30.0) -> "RedisBatchStore":
        # Files may be large: a generous socket timeout, unlike the prefix index's fail-fast client.
        return cls(aioredis.Redis.from_url(url, socket_timeout=60, socket_connect_timeout=5), namespace, lease_s)

    async def close(self) -> None:
        await self.redis.aclose()

    def key(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    # --- files --------------------------------------------------------------------------------------

    async def save_file(self, obj: dict) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.set(self.key("file", obj["id"]), _encode(obj))
            p.sadd(self.key("files"), obj["id"])
            if obj.get("expires_at") is not None:
                p.expireat(self.key("file", obj["id"]), obj["expires_at"])
                p.expireat(self.key("file", obj["id"], "data"), obj["expires_at"])
            await p.execute()

    async def load_file(self, file_id: str) -> dict | None:
        return _load(await self.redis.get(self.key("file", file_id)))

    async def delete_file(self, file_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(self.key("file", file_id), self.key("file", file_id, "data"))
            p.srem(self.key("files"), file_id)
            await p.execute()

    async def file_ids(self) -> list[str]:
        return await self._live_ids("files", "file")

    async def write_data(self, file_id: str, data: bytes) -> None:
        await self.redis.set(self.key("file", file_id, "data"), data)

    async def read_data(self, file_id: str) -> bytes:
        data = await self.redis.get(self.key("file", file_id, "data"))
        if data is None:
            raise FileNotFoundError(file_id)
        return data

    # --- batches ------------------------------------------------------------------------------------

    async def save_batch(self, record: dict, lease: str | None = None) -> None:
        """Unconditionally when new (`lease` None); else only while `lease` holds it, or LeaseLost."""
        batch_id = record["batch"]["id"]
        if lease is None:
            async with self.redis.pipeline(transaction=True) as p:
                p.set(self.key("batch", batch_id), _encode(record))
                p.sadd(self.key("batches"), batch_id)
                await p.execute()
        elif await self._save(keys=[self.key("lease", batch_id), self.key("batch", batch_id)],
                              args=[lease, _encode(record)]) != 1:
            raise LeaseLost(batch_id)

    async def load_batch(self, batch_id: str) -> dict | None:
        return _load(await self.redis.get(self.key("batch", batch_id)))

    async def delete_batch(self, batch_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(*(self.key(kind, batch_id) for kind in ("batch", "results", "counts", "lease", "cancel")))
            p.srem(self.key("batches"), batch_id)
            await p.execute()

    async def batch_ids(self) -> list[str]:
        return await self._live_ids("batches", "batch")

    def results(self, batch_id: str) -> "RedisResultLog":
        return RedisResultLog(self, batch_id)

    # --- who runs a batch -----------------------------------------------------------------------------

    async def claim(self, batch_id: str) -> str | None:
        """A lease on the batch (its token), or None while another gateway holds one."""
        token = f"{self._owner}:{os.urandom(8).hex()}"
        ok = await self.redis.set(self.key("lease", batch_id), token, nx=True, px=self._lease_ms)
        return token if ok else None

    async def renew(self, batch_id: str, lease: str) -> bool:
        return await self._renew(keys=[self.key("lease", batch_id)], args=[lease, self._lease_ms]) == 1

    async def release(self, batch_id: str, lease: str) -> None:
        await self._release(keys=[self.key("lease", batch_id)], args=[lease])

    async def request_cancel(self, batch_id: str) -> None:
        await self.redis.set(self.key("cancel", batch_id), now(), nx=True)

    async def cancel_requested(self, batch_id: str) -> int | None:
        """When a cancel was asked, if one was."""
        asked = await self.redis.get(self.key("cancel", batch_id))
        return None if asked is None else int(asked)

    @property
    def _lease_ms(self) -> int:
        return max(1, int(self.lease_s * 1000))

    async def _live_ids(self, index: str, kind: str) -> list[str]:
        """The ids in a set whose objects still exist; those that expired leave the set."""
        ids = sorted(i.decode() for i in await self.redis.smembers(self.key(index)))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for i in ids:
                p.exists(self.key(kind, i))
            present = await p.execute()
        gone = [i for i, p in zip(ids, present) if not p]
        if gone:
            await self.redis.srem(self.key(index), *gone)
        return [i for i, p in zip(ids, present) if p]


class RedisResultLog:
    """A batch's finished lines in Redis: {"index", "ok", "line"} records, one per index."""

    def __init__(self, store: RedisBatchStore, batch_id: str) -> None:
        self.store, self.batch_id = store, batch_id

    async def records(self) -> list[dict]:
        return [_decode(v) for v in await self.store.redis.hvals(self.store.key("results", self.batch_id))]

    async def counts(self) -> tuple[int, int]:
        """(completed, failed) lines."""
        ok, failed = await self.store.redis.hmget(self.store.key("counts", self.batch_id), "completed", "failed")
        return int(ok or 0), int(failed or 0)

    async def append(self, record: dict, lease: str | None = None) -> bool:
        """Recorded when this returns True; False when the line was already recorded; LeaseLost when
        another gateway runs the batch now."""
        s = self.store
        done = await s._append(keys=[s.key("lease", self.batch_id), s.key("results", self.batch_id),
                                     s.key("counts", self.batch_id)],
                               args=[lease or "", record["index"], _encode(record),
                                     "completed" if record["ok"] else "failed"])
        if done == -1:
            raise LeaseLost(self.batch_id)
        return done == 1


def _load(raw: bytes | None) -> dict | None:
    if raw is None:
        return None
    try:
        return _decode(raw)
    except msgspec.DecodeError:
        return None
