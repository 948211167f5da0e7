"""What the HTTP side calls on its engines, whether one embedded engine (`EngineClient`) or a
cluster of remote ones (`EnginePool`) serves it.

Both classes implement `EngineConnection`; the gateway's state, generations and pages hold one and
never ask which. A call added here must be added to both (tests/gateway/test_engine_connection.py).
"""
from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

from actors.messages.front_end import (
    EngineStats, ListLoRAAdapters, LoadLoRAAdapter, LoRAAdapters, LoRAOutcome, SamplingParams,
    UnloadLoRAAdapter,
)


@runtime_checkable
class EngineConnection(Protocol):
    @property
    def alive(self) -> bool:
        """An engine is there to take requests."""

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               queue: asyncio.Queue, priority: int = 0, request_salt: str | None = None,
               ballast: bool = False, lora_name: str | None = None) -> None:
        """Start a request: its TokenDeltas (or an EngineLost / RequestFailed) go to `queue` until
        `release(request_id)`; its prompt blocks are salted for the tenant of the HTTP request, and
        with `request_salt` (vLLM's cache_salt) when the request sends one. `ballast`: a batch
        line, scheduled below every interactive request. `lora_name`: the LoRA adapter it generates
        with."""

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort one sample (`index`) or the whole request; the engine frees its blocks."""

    def release(self, request_id: str) -> None:
        """The request is done with: nothing more goes to its queue."""

    async def engine_stats(self, timeout: float = 2.0) -> dict[str, EngineStats]:
        """The latest stats of each engine, by engine id."""

    async def manage_lora(self, msg: LoadLoRAAdapter | UnloadLoRAAdapter | ListLoRAAdapters,
                          timeout: float = 600.0) -> LoRAOutcome | LoRAAdapters:
        """Loads or unloads a LoRA adapter on the engines, or lists theirs: one outcome for all."""
