"""The gateway's side of the engine protocol: submit, abort, stats, and token routing.

A receiver actor's ref goes in SubmitRequest.reply_to; it routes each TokenDelta to the asyncio
queue of its request. Only actor messages cross to the engine, so it may live in another process.
"""
from __future__ import annotations

import asyncio

from actors.messages.front_end import (
    AbortRequest, EngineStats, GetStats, ListLoRAAdapters, LoadLoRAAdapter, LoRAAdapters, LoRAOutcome,
    SamplingParams, SubmitRequest, UnloadLoRAAdapter, TokenDeltas,
)
from gateway.tenant import current_cache_salt
from prefix_store import TenantSalts
from runtime import Actor, ActorRef, ActorSystem, Terminated


class EngineLost(Exception):
    """Put on every open stream when the engine dies."""


class RequestFailed(Exception):
    """The request failed on the server (the engine failed a sample, or it could not be sent);
    the message is safe to show the client."""


class DeltaReceiver(Actor):
    """Routes TokenDeltas to per-request queues; fails open streams when the engine dies."""

    def __init__(self, queues: dict[str, asyncio.Queue], scheduler: ActorRef) -> None:
        self._queues = queues
        self._scheduler = scheduler

    async def on_start(self) -> None:
        self.context.watch(self._scheduler)

    async def receive(self, msg) -> None:
        match msg:
            case TokenDeltas(deltas=deltas):
                queues = self._queues
                for d in deltas:
                    q = queues.get(d.request_id)
                    if q is not None:
                        q.put_nowait(d)
            case Terminated():
                lost = EngineLost("the engine stopped while the request was running")
                for q in set(self._queues.values()):
                    q.put_nowait(lost)


class EngineClient:
    """Submits requests to one scheduler and hands back a queue of TokenDeltas per request: the
    gateway's `EngineConnection` to an engine of its own process (or one remote scheduler)."""

    def __init__(self, scheduler: ActorRef, receiver: ActorRef,
                 queues: dict[str, asyncio.Queue], salts: TenantSalts | None = None) -> None:
        self.scheduler = scheduler
        self._receiver = receiver
        self._queues = queues
        self.salts = salts

    @classmethod
    async def start(cls, system: ActorSystem, scheduler: ActorRef, name: str = "gateway-receiver",
                    salts: TenantSalts | None = None) -> EngineClient:
        queues: dict[str, asyncio.Queue] = {}
        receiver = await system.spawn(DeltaReceiver(queues, scheduler), name=name)
        return cls(scheduler, receiver, queues, salts)

    @property
    def alive(self) -> bool:
        return self.scheduler.is_alive

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               queue: asyncio.Queue, priority: int = 0, request_salt: str | None = None,
               ballast: bool = False, lora_name: str | None = None) -> None:
        """Deltas for `request_id` go to `queue` until `release(request_id)`; its prompt blocks
        are salted for the tenant of the HTTP request being handled, and with the request's own
        `request_salt` (vLLM's cache_salt)."""
        self._queues[request_id] = queue
        self.scheduler.tell(SubmitRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                          params=params, reply_to=self._receiver, priority=priority,
                                          cache_salt=current_cache_salt(self.salts, request_salt),
                                          ballast=ballast, lora_name=lora_name))

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort one sample (`index`) or the whole request; the engine frees its blocks."""
        self.scheduler.tell(AbortRequest(request_id=request_id, index=index))

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def stats(self, timeout: float = 2.0) -> EngineStats:
        return await self.scheduler.ask(GetStats(), timeout=timeout)

    async def manage_lora(self, msg: LoadLoRAAdapter | UnloadLoRAAdapter | ListLoRAAdapters,
                          timeout: float = 600.0) -> LoRAOutcome | LoRAAdapters:
        return await self.scheduler.ask(msg, timeout=timeout)

    async def engine_stats(self, timeout: float = 2.0) -> dict[str, EngineStats]:
        """The pool's interface: this one engine's stats, as engine "0"."""
        return {"0": await self.stats(timeout)}
