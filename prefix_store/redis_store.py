"""Redis prefix index: the cluster-wide twin of the in-memory store.

Every operation is one round trip (concurrent matches share theirs): a Lua script, atomic so
a batch of events is applied whole or not at all, or one MULTI pipeline. Nothing blocks for
long: short socket timeouts, a small bounded retry, and callers add their own deadline.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable, Sequence

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefix_store import lua
from prefix_store.coalescer import Coalescer
from prefix_store.events import AllBlocksCleared, ApplyResult, BlockStored, KVEvent, index_keys
from prefix_store.store import PrefixStore, validate_ttl


# Event kinds on the wire to the apply script.
_STORED, _REMOVED, _CLEARED = 1, 2, 3
# A snapshot being staged must outlive its upload, however slow; then it frees itself.
_STAGE_TTL_MS = 120_000


def make_client(
    url: str,
    *,
    socket_timeout_s: float = 0.25,
    connect_timeout_s: float = 0.25,
    retries: int = 1,
    max_connections: int = 16,
    pool_timeout_s: float = 1.0,
) -> redis.Redis:
    """A client that fails fast: a dead Redis must cost a request milliseconds, not seconds.

    A burst of lookups queues for one of a few connections (each lookup takes well under a
    millisecond) instead of opening hundreds of sockets, or failing once the pool is empty.
    """
    if socket_timeout_s <= 0 or connect_timeout_s <= 0 or pool_timeout_s <= 0:
        raise ValueError("Redis timeouts must be positive")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(ExponentialWithJitterBackoff(cap=0.05, base=0.005), retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
        decode_responses=False,
    )
    return redis.Redis.from_pool(pool)


class RedisPrefixStore(PrefixStore):
    """Keys: `{ns}:engines` (engine -> deadline), `{ns}:blocks:<engine>` (hash -> refcount),
    `{ns}:seq:<engine>` (last applied sequence number), and `{ns}:stage:<engine>:<id>` while a
    large snapshot uploads."""

    def __init__(self, client: redis.Redis, namespace: str = "matinee:prefix", ttl_s: float = 10.0,
                 *, owns_client: bool = False, max_match_batch: int = 64, snapshot_chunk: int = 2048):
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must be non-empty and without braces, got {namespace!r}")
        self.ttl_s = validate_ttl(ttl_s)
        self._ttl_ms = max(1, int(self.ttl_s * 1000))
        self._client = client
        self._owns_client = owns_client  # a client shared with others is theirs to close
        if snapshot_chunk < 1:
            raise ValueError(f"snapshot_chunk must be >= 1, got {snapshot_chunk}")
        self._snapshot_chunk = snapshot_chunk
        self._prefix = "{" + namespace + "}"
        self._engines_key = f"{self._prefix}:engines"
        self._apply = client.register_script(lua.APPLY_EVENTS)
        self._snapshot = client.register_script(lua.PUBLISH_SNAPSHOT)
        self._heartbeat = client.register_script(lua.HEARTBEAT)
        self._match = client.register_script(lua.MATCH)
        self._live = client.register_script(lua.LIVE_ENGINES)
        self._coalescer = Coalescer(self._match_many, max_batch=max_match_batch)

    @classmethod
    def from_url(cls, url: str, namespace: str = "matinee:prefix", ttl_s: float = 10.0, *,
                 max_match_batch: int = 64, snapshot_chunk: int = 2048, **client_kw) -> RedisPrefixStore:
        """A store with its own client (`make_client`'s keywords), closed with the store."""
        return cls(make_client(url, **client_kw), namespace=namespace, ttl_s=ttl_s, owns_client=True,
                   max_match_batch=max_match_batch, snapshot_chunk=snapshot_chunk)

    def _keys(self, engine_id: str) -> list[str]:
        if not engine_id:
            raise ValueError("engine_id must be non-empty")
        return [self._engines_key, f"{self._prefix}:blocks:{engine_id}", f"{self._prefix}:seq:{engine_id}"]

    async def load_scripts(self) -> None:
        """Load the scripts up front, so the first routing decision is one round trip too."""
        for script in (self._apply, self._snapshot, self._heartbeat, self._match, self._live):
            script.sha = await self._client.script_load(script.script)

    async def apply_events(self, engine_id: str, events: Sequence[KVEvent]) -> ApplyResult:
        args: list[object] = [engine_id, self._ttl_ms]
        for event in events:
            if isinstance(event, AllBlocksCleared):
                args += (event.seq, _CLEARED, 0)
            else:
                kind = _STORED if isinstance(event, BlockStored) else _REMOVED
                args += (event.seq, kind, len(event.block_hashes), *index_keys(event))
        applied = await self._apply(keys=self._keys(engine_id), args=args)
        return ApplyResult.APPLIED if applied == 1 else ApplyResult.NEED_SNAPSHOT

    async def publish_snapshot(
        self, engine_id: str, block_hashes: Iterable[bytes], next_seq: int
    ) -> None:
        """One round trip up to `snapshot_chunk` distinct hashes; beyond, one per chunk."""
        keys = self._keys(engine_id)
        stage = f"{self._prefix}:stage:{engine_id}:{uuid.uuid4().hex}"
        items = list(Counter(block_hashes).items())
        staged = len(items) > self._snapshot_chunk
        if staged:
            for start in range(0, len(items), self._snapshot_chunk):
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.hset(stage, mapping=dict(items[start:start + self._snapshot_chunk]))
                    pipe.pexpire(stage, _STAGE_TTL_MS)
                    await pipe.execute()
            items = []
        args: list[object] = [engine_id, self._ttl_ms, next_seq, int(staged)]
        for key, count in items:
            args += (key, count)
        if await self._snapshot(keys=[*keys, stage], args=args) != 1:
            raise RuntimeError(f"the staged snapshot of {engine_id!r} expired before it was swapped in")

    async def clear_engine(self, engine_id: str) -> None:
        engines, blocks, seq = self._keys(engine_id)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.zrem(engines, engine_id).delete(blocks, seq)
            await pipe.execute()

    async def heartbeat(self, engine_id: str) -> bool:
        return await self._heartbeat(keys=self._keys(engine_id), args=[engine_id, self._ttl_ms]) == 1

    async def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        return {engine_id: pool for engine_id, (pool, _) in (await self.match_tiers(block_hashes)).items()}

    async def match_tiers(self, block_hashes: Sequence[bytes]) -> dict[str, tuple[int, int]]:
        """One round trip, shared with the lookups made at the same moment."""
        return await self._coalescer(block_hashes)

    async def _match_many(self, prompts: list[Sequence[bytes]]) -> list[dict[str, tuple[int, int]]]:
        args: list[object] = [f"{self._prefix}:blocks:", len(prompts), *(len(p) for p in prompts)]
        for prompt in prompts:
            args += prompt
        engines, *counts = await self._match(keys=[self._engines_key], args=args)
        names = [e.decode() for e in engines]
        return [dict(zip(names, zip(per_prompt[::2], per_prompt[1::2]))) for per_prompt in counts]

    async def live_engines(self) -> list[str]:
        return sorted(e.decode() for e in await self._live(keys=[self._engines_key]))

    async def close(self) -> None:
        await self._coalescer.close()
        if self._owns_client:
            await self._client.aclose()
