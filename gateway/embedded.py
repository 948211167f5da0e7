"""The embedded deployment (`--role all`): the engine's actors in the gateway's own process.

The gateway still reaches the engine only through its scheduler ref, as it would a remote one.
"""
from __future__ import annotations

from actors.config import EngineConfig
from gateway.state import EngineHandle, EngineLauncher
from runtime import ActorSystem


def engine_handle(engine) -> EngineHandle:
    """An `actors.engine.Engine` as the gateway sees it."""
    return EngineHandle(scheduler=engine.scheduler, tokenizer=engine.tokenizer,
                        max_model_len=engine.max_model_len, model_path=engine.config.model,
                        close=engine.stop,
                        priority_scheduling=engine.config.scheduling_policy == "priority")


def embedded_launcher(config: EngineConfig) -> EngineLauncher:
    async def launch(system: ActorSystem) -> EngineHandle:
        from actors.engine import start_engine   # deferred: pulls in torch and the model code

        return engine_handle(await start_engine(config, system))

    return launch
