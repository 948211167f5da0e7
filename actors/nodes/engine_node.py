"""The engine roles of a cluster: one engine in its own node, reachable over TCP, found via Redis.

The node registers a front actor under `engines/<id>`, or `engines/prefill/<id>` and
`engines/decode/<id>` for a disaggregated engine (TTL heartbeat), publishes its KV events to the
prefix index, and on SIGTERM drains: it leaves the registry, refuses new requests (their gateway
routes them elsewhere) and finishes its running ones within a grace period. Every role is a whole
engine; the role says what gateways send it, and its KV transfer actor hands KV over or takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.config import EngineConfig
from actors.kv.transfer import KVTransfer, KVTransferConfig
from actors.scheduler.pull_cost import PullCost
from actors.messages.front_end import (
    AbortRequest, EngineInfo, GetEngineInfo, GetStats, SubmitRefused, SubmitRequest,
)
from actors.messages.kv import KVEventsWaiting, SubscribeKVEvents
from runtime import Actor, ActorRef, ActorSystem, get_logger

log = get_logger(component="engine-node")

REGISTRY_PREFIX = "engines/"
ENGINE_ROLES = ("engine", "prefill", "decode")


@dataclass
class EngineNodeConfig:
    # `metadata={"help": ...}` makes a field a `matinee serve` flag (gateway/flags.py); the secret
    # never is one: it comes from the environment alone.
    secret: bytes
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={
        "help": "the registry and the prefix index (the gateway's too)"})
    listen_host: str = field(default="127.0.0.1", metadata={"help": "the engine node's TCP address for gateways"})
    listen_port: int = field(default=7100, metadata={"help": "the engine node's TCP port"})
    advertise: str | None = field(default=None, metadata={
        "help": "host:port gateways dial (unset: this host's name and --listen-port)"})
    # Stable across restarts, so a restart clears its entries.
    engine_id: str | None = field(default=None, metadata={
        "help": "the engine's id in the prefix index, or a draft node's id (unset: host name and port)"})
    drain_grace_s: float = field(default=30.0, metadata={
        "help": "seconds a stopping engine lets its running requests finish", "flag": "drain-grace"})
    registry_ttl_s: float = field(default=3.0, metadata={
        "help": "seconds a dead engine stays in the registry", "flag": "registry-ttl"})
    metrics_port: int | None = field(default=None, metadata={
        "help": "the engine node's HTTP port for its own /metrics and /ready, on --listen-host (unset: none)",
        "type": "int_or_none"})
    index_ttl_s: float = 10.0
    index_namespace: str = "matinee:prefix"
    registry_prefix: str = "matinee:registry:"
    role: str = "engine"              # `--role`: engine (colocated), prefill or decode

    def __post_init__(self) -> None:
        if not self.secret:
            raise ValueError("an engine node needs the cluster secret (MATINEE_CLUSTER_SECRET)")
        if self.role not in ENGINE_ROLES:
            raise ValueError(f"an engine's role is one of {ENGINE_ROLES}, got {self.role!r}")
        if not 0 <= self.listen_port < 65536:
            raise ValueError(f"listen_port must be in [0, 65535], got {self.listen_port}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [1, 65535], got {self.metrics_port}")
        for name in ("drain_grace_s", "registry_ttl_s", "index_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.advertise is None:
            host = self.listen_host
            if host in ("0.0.0.0", "::", ""):
                host = socket.gethostname()   # in compose: the container's name on the network
            self.advertise = f"{host}:{self.listen_port}" if self.listen_port else None
        if self.engine_id is None:
            self.engine_id = f"{socket.gethostname()}-{self.listen_port}"


def registry_name(role: str, engine_id: str) -> str:
    """The engine's registry entry: its role is in the name, so Redis shows it."""
    return REGISTRY_PREFIX + ("" if role == "engine" else f"{role}/") + engine_id


class BeginDrain:
    """Local only: stop admitting."""


class EngineFront(Actor):
    """What gateways talk to: forwards the engine protocol to the scheduler, refuses new
    requests once draining, and says what this engine serves."""

    def __init__(self, info: EngineInfo, scheduler: ActorRef):
        self.info = info
        self.scheduler = scheduler

    async def receive(self, msg: Any) -> Any:
        match msg:
            case SubmitRequest():
                if self.info.draining:
                    msg.reply_to.tell(SubmitRefused(msg.request_id, "engine draining"))
                else:
                    self.scheduler.tell(msg)
            case AbortRequest():
                self.scheduler.tell(msg)
            case GetStats():
                return await self.scheduler.ask(msg)
            case GetEngineInfo():
                return self.info
            case BeginDrain():
                self.info = msgspec.structs.replace(self.info, draining=True)
            case _:
                return await super().receive(msg)
        return None


class _IndexWaker(Actor):
    """Hears from the KV actor that events are waiting and wakes the prefix index's publisher,
    which then asks for them."""

    def __init__(self, wake: Callable[[], None]):
        self.wake = wake

    async def receive(self, msg: Any) -> Any:
        match msg:
            case KVEventsWaiting():
                self.wake()
                return None
        return await super().receive(msg)


async def start_node_system(node: EngineNodeConfig, name: str, stop: asyncio.Event) -> ActorSystem:
    """A cluster node's actor system, listening on the node's address and registered through Redis;
    SIGTERM and SIGINT set `stop`."""
    from runtime.redis_registry import RedisRegistry

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    registry = RedisRegistry(node.redis_url, secret=node.secret, prefix=node.registry_prefix,
                             ttl_s=node.registry_ttl_s)
    system = ActorSystem(name, listen=(node.listen_host, node.listen_port), secret=node.secret,
                         registry=registry, advertise=node.advertise)
    await system.start()
    return system


async def attach_kv_transfer(system: ActorSystem, engine: Any, config: KVTransferConfig | None = None,
                             name: str = "engine") -> ActorRef:
    """The engine's KV transfer actor (`{name}-kv-transfer`): it hands prefilled requests to decode
    engines and takes them over from prefill engines."""
    config = config or KVTransferConfig()
    ref = await system.spawn(KVTransfer(engine.kv_blocks, engine.scheduler, engine.config.block_size, config,
                                        engine.kv), name=f"{name}-kv-transfer")
    engine.scheduler_actor.transfer = ref
    engine.scheduler_actor.pulls.enabled = engine.kv_tier is not None   # pulled blocks land in the tier
    engine.scheduler_actor.pulls.cost = PullCost(engine.config.block_size, engine.kv_blocks.bytes_per_block)
    engine.scheduler_actor.block_layout = engine.kv_blocks.layout
    # Layer by layer the transfer reads the cache while the forward runs: only where that needs no device sync.
    engine.scheduler_actor.layer_stream = config.by_layer and engine.kv_blocks.on_host
    return ref


async def run_engine_node(node: EngineNodeConfig, engine_config: EngineConfig,
                          stop: asyncio.Event | None = None, transfer: KVTransferConfig | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or `stop`), then drain and exit. Returns the exit code."""
    from actors.engine import start_engine   # deferred: torch and the model code
    from actors.kv.kv_actor import KVActorEvents
    from prefix_store import IndexPublisher, RedisPrefixStore

    stop = stop or asyncio.Event()
    system = await start_node_system(node, f"engine-{node.engine_id}", stop)
    engine = await start_engine(engine_config, system, name="engine")
    store = RedisPrefixStore.from_url(node.redis_url, namespace=node.index_namespace,
                                      ttl_s=node.index_ttl_s)
    # The publisher asks the KV actor for its events, woken whenever a transaction recorded some.
    publisher = IndexPublisher(store, node.engine_id, KVActorEvents(engine.kv))
    await publisher.start()   # drops whatever a previous run left under this id
    waker = await system.spawn(_IndexWaker(publisher.notify), name="engine-index-waker")
    engine.kv.tell(SubscribeKVEvents(waker))
    tasks = [asyncio.create_task(publisher.run())]
    kv_transfer = await attach_kv_transfer(system, engine, transfer)
    info = EngineInfo(node.engine_id, engine.max_model_len, engine_config.block_size,
                      engine_config.model or "", priority_scheduling=engine_config.scheduling_policy == "priority",
                      role=node.role, kv_receiver=kv_transfer, kv_layout=engine.kv_blocks.layout)
    # A fresh path per run: gateways tell a restarted engine from the one they saw die.
    front = await system.spawn(EngineFront(info, engine.scheduler), name=f"front-{uuid.uuid4().hex[:8]}")
    name = registry_name(node.role, node.engine_id)
    await system.publish(name, front)
    serving = True
    http = None
    if node.metrics_port is not None:
        from actors.nodes.engine_http import create_engine_http, start_engine_http
        from actors.stats.engine_metrics import model_name_from_path

        app = create_engine_http(engine.scheduler, lambda: serving,
                                 model_name_from_path(engine_config.model or "") or "matinee", node.engine_id)
        http = await start_engine_http(app, node.listen_host, node.metrics_port)
    log.info("engine node serving", engine_id=node.engine_id, role=node.role, address=system.address)
    print(f"matinee {node.role} engine {node.engine_id} serving at {system.address}", flush=True)

    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, system.terminated], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    serving = False
    try:
        if not system.terminated.done():
            await _drain(system, name, front, engine.scheduler, node.drain_grace_s)
    finally:
        if http is not None:
            await http.cleanup()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await publisher.stop()
        await store.close()
        await system.shutdown()
    return system.exit_code or 0


async def _drain(system: ActorSystem, name: str, front: ActorRef, scheduler: ActorRef,
                 grace_s: float) -> None:
    """Leave the registry, refuse new work, let running requests finish (up to `grace_s`);
    what is left when the node stops, its gateways migrate."""
    log.info("draining", grace_s=grace_s)
    with contextlib.suppress(Exception):
        await system.unpublish(name)
    front.tell(BeginDrain())
    deadline = asyncio.get_running_loop().time() + grace_s
    while asyncio.get_running_loop().time() < deadline:
        try:
            stats = await scheduler.ask(GetStats(), timeout=2.0)
        except Exception:
            return
        if stats.requests_running + stats.requests_waiting == 0:
            return
        await asyncio.sleep(0.05)
    log.warning("drain grace period over; stopping with requests still running")
