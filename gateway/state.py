"""What the gateway's handlers share: config, metrics, the engine connection and its tokenizer.

The engine comes up in the background (loading weights takes a while), so until it is ready
`/ready` says 503 and generation routes answer 503 rather than hang.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from actors.stats.engine_metrics import model_name_from_path
from actors.messages.front_end import ListLoRAAdapters
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.engine_connection import EngineConnection
from gateway.errors import APIError, not_found, unavailable
from gateway.generation import Generation
from gateway.metrics import GatewayMetrics
from gateway.responses import TokenStrings
from prefix_store import TenantSalts
from runtime import ActorRef, ActorSystem


@dataclass
class EngineHandle:
    """A running engine as the gateway sees it: a scheduler ref and what requests need."""

    scheduler: ActorRef
    tokenizer: Any                       # actors.text.tokenizer.Tokenizer, or anything with its calls
    max_model_len: int
    model_path: str = ""
    close: Callable[[], Awaitable[None]] | None = None
    client: EngineConnection | None = None   # a ready one (a cluster's EnginePool); None: one for `scheduler`
    priority_scheduling: bool = False    # the engine orders requests by `priority`


EngineLauncher = Callable[[ActorSystem], Awaitable[EngineHandle]]


@dataclass
class GatewayState:
    config: GatewayConfig
    launcher: EngineLauncher
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    system: ActorSystem | None = None
    engine: EngineHandle | None = None
    client: EngineConnection | None = None   # an EngineClient, or a cluster's EnginePool
    token_strings: TokenStrings | None = None
    model_name: str = ""                 # the name responses report: the first of model_names
    model_names: list[str] = field(default_factory=list)   # every name `model` may give
    loras: dict[str, str] = field(default_factory=dict)    # LoRA adapters `model` may name -> their folders
    draining: bool = False
    startup_error: str | None = None
    generations: set[Generation] = field(default_factory=set)
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)

    async def connect(self) -> None:
        """Start the engine (or reach it) and the receiver; then the gateway is ready."""
        engine = await self.launcher(self.system)
        if self.config.chat_template is not None:   # this gateway's own, the engine's untouched
            engine = dataclasses.replace(
                engine, tokenizer=engine.tokenizer.with_chat_template(self.config.chat_template))
        self.engine = engine
        # One engine in this process: its prefix cache lives as long as the process, so a random
        # secret salts tenants apart as the cluster's shared secret does across processes.
        self.client = engine.client or await EngineClient.start(
            self.system, engine.scheduler, salts=TenantSalts(os.urandom(32)))
        self.token_strings = TokenStrings(engine.tokenizer)
        self.model_names = self.config.model_names or [model_name_from_path(engine.model_path) or "matinee"]
        self.model_name = self.model_names[0]
        await self.refresh_loras()
        self.metrics.set_model(self.model_name)
        self.ready_event.set()

    @property
    def ready(self) -> bool:
        return self.client is not None and self.client.alive and not self.draining

    def require_engine(self) -> tuple[EngineConnection, EngineHandle]:
        if self.draining:
            raise unavailable("The server is shutting down.")
        if not self.ready:
            raise unavailable()
        return self.client, self.engine

    async def refresh_loras(self) -> None:
        """The LoRA adapters the engines hold now (a cluster's engines may start after this gateway)."""
        self.loras = (await self.client.manage_lora(ListLoRAAdapters())).adapters

    async def resolve_model(self, model: str | None) -> str | None:
        """check_model, after asking the engines for their adapters when `model` names nothing known here."""
        if not self._is_base(model) and model not in self.loras:
            await self.refresh_loras()
        return self.check_model(model)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names, None for the base model; 404 for a name served by neither."""
        if self._is_base(model):
            return None
        if model in self.loras:
            return model
        raise not_found(f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def _is_base(self, model: str | None) -> bool:
        """A name of the base model, or none given."""
        return model is None or model in self.model_names or (self.engine is not None and model == self.engine.model_path)

    def check_capacity(self, num_sequences: int) -> None:
        """429 unless `num_sequences` more fit under max_waiting: sequences count, not requests,
        so one request with many prompts and a large `n` cannot fill the queue alone. An empty
        queue takes any one request (its size is capped per request). Batch lines wait apart: they
        never fill the queue that interactive requests are refused by."""
        waiting = sum(g.num_waiting for g in self.generations if not g.ballast)
        if waiting and waiting + num_sequences > self.config.max_waiting:
            raise APIError(429, f"Too many sequences waiting ({waiting}); retry later.",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})
