"""The serving actors and their protocol; `from actors import LLM, SamplingParams` is the offline API.

The engine (and torch) load only when LLM, start_engine or EngineConfig is first used, so the
gateway can import the messages cheaply.
"""

from actors.messages.front_end import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "start_engine"]


def __getattr__(name: str):
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from actors import llm
        return getattr(llm, name)
    if name == "start_engine":
        from actors.engine import start_engine
        return start_engine
    if name == "EngineConfig":
        from actors.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'actors' has no attribute {name!r}")
