"""The gateway role of a cluster: the same HTTP app, served by an `EnginePool` of remote engines.

The gateway loads only the tokenizer; engines are found in the Redis registry and reached over
the runtime's TCP transport with the cluster secret. /ready is 200 while some engine is routable.
Files and batches live in the same Redis, so any gateway answers for any batch and runs it on.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field

from aiohttp import web

from gateway.app import create_app
from gateway.app_keys import STATE
from gateway.batches_api import BATCH_STORE
from gateway.config import GatewayConfig
from gateway.engine_pool import EnginePool, PoolConfig
from gateway.metrics import GatewayMetrics
from gateway.pool_metrics import PoolMetrics
from gateway.state import EngineHandle
from runtime import ActorSystem


@dataclass
class GatewayNodeConfig:
    secret: bytes
    redis_url: str = "redis://127.0.0.1:6379/0"
    tokenizer: str | None = None             # model folder or .gguf; None: the default model
    pool: PoolConfig | None = None
    index_namespace: str = "matinee:prefix"
    registry_prefix: str = "matinee:registry:"
    batch_namespace: str = "matinee:batch"
    batch_lease_s: float = field(default=30.0, metadata={
        "help": "seconds a gateway holds a batch it runs (renewed every third of it); a gateway that dies "
                "mid-batch leaves it to another after this long", "flag": "batch-lease"})
    index_timeout_s: float = field(default=0.1, metadata={   # a `matinee serve` flag (gateway/flags.py)
        "help": "seconds a prefix-index lookup may take before routing falls back to load",
        "flag": "index-timeout"})

    def __post_init__(self) -> None:
        if not self.secret:
            raise ValueError("a gateway node needs the cluster secret (MATINEE_CLUSTER_SECRET)")
        if self.index_timeout_s <= 0:
            raise ValueError(f"index_timeout_s must be positive, got {self.index_timeout_s}")
        if self.batch_lease_s <= 0:
            raise ValueError(f"batch_lease_s must be positive, got {self.batch_lease_s}")
        self.pool = self.pool or PoolConfig()


class ClusterMetrics(GatewayMetrics):
    """The gateway's own metrics and the pool's (routing, index latency, migrations); no engine's."""

    def __init__(self) -> None:
        super().__init__(engine_in_process=False)
        self.pool: PoolMetrics | None = None

    def attach_pool(self, pool: PoolMetrics) -> None:
        self.pool = pool
        self.registry.register(pool)


def cluster_launcher(node: GatewayNodeConfig, metrics: ClusterMetrics | None = None):
    async def launch(system: ActorSystem) -> EngineHandle:
        from actors.config import default_model_path
        from actors.model.hub import TOKENIZER_FILES, local_model_path
        from actors.text.tokenizer import load_tokenizer
        from prefix_store import PrefixRouter, RedisPrefixStore, TenantSalts
        from runtime.redis_registry import RedisRegistry

        registry = RedisRegistry(node.redis_url, secret=node.secret, prefix=node.registry_prefix)
        store = RedisPrefixStore.from_url(node.redis_url, namespace=node.index_namespace)
        router = PrefixRouter(store, timeout_s=node.index_timeout_s)
        salts = TenantSalts(b"tenant-salt:" + node.secret)
        pool = EnginePool(system, registry, router, node.pool, salts)
        await pool.start()
        tokenizer_path = await asyncio.to_thread(local_model_path, node.tokenizer or default_model_path(),
                                                 TOKENIZER_FILES)
        tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
        info = await pool.wait_for_engine()

        async def close() -> None:
            await pool.close()
            await registry.close()

        if metrics is not None:   # shown once the gateway can serve
            metrics.attach_pool(pool.metrics)
        return EngineHandle(scheduler=pool.receiver, tokenizer=tokenizer, max_model_len=info.max_model_len,
                            model_path=info.model or tokenizer_path, close=close, client=pool,
                            priority_scheduling=info.priority_scheduling)

    return launch


def create_cluster_app(config: GatewayConfig, node: GatewayNodeConfig) -> web.Application:
    system = ActorSystem(f"gateway-{socket.gethostname()}", secret=node.secret)
    metrics = ClusterMetrics()
    app = create_app(config, cluster_launcher(node, metrics), system)
    app[STATE].metrics = metrics

    async def batch_store():
        from gateway.redis_batch_store import RedisBatchStore
        return RedisBatchStore.from_url(node.redis_url, node.batch_namespace, node.batch_lease_s)

    app[BATCH_STORE] = batch_store

    async def own_system(app: web.Application):
        await system.start()
        yield
        await system.shutdown()

    app.cleanup_ctx.insert(0, own_system)   # started first, shut down last
    return app
