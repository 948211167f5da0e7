"""Where a cluster gateway sends a request for a LoRA adapter: to an engine already running that
adapter's requests while nothing waits there, else to one with an adapter slot free, else to any (the
router then weighs prefix and load). Plain functions over the engines' latest stats."""
from __future__ import annotations

from actors.messages.front_end import EngineInfo, EngineStats
from gateway.engine_pool import _Engine, _with_adapter


def engine(name: str, running: dict[str, int] | None = None, waiting: int = 0, max_loras: int = 2,
           stats: bool = True) -> _Engine:
    s = EngineStats(1, waiting, 100, 50, 0, 0, 0, 0, 0, max_loras=max_loras, lora_running=running or {})
    return _Engine(name, None, EngineInfo(name, 1024, 16, "m"), s if stats else None)


def names(engines) -> list[str]:
    return [e.key for e in engines]


def test_an_engine_running_the_adapter_is_preferred():
    pool = [engine("a", {"x": 1}), engine("b", {}), engine("c", {"x": 2, "y": 1})]
    assert names(_with_adapter(pool, "x")) == ["a", "c"]


def test_a_busy_holder_gives_way_to_engines_with_a_slot_free():
    pool = [engine("a", {"x": 1, "w": 1}, waiting=3), engine("b", {"y": 1, "z": 1}), engine("c", {"y": 1})]
    assert names(_with_adapter(pool, "x")) == ["c"]


def test_an_engine_without_stats_counts_as_free_and_with_no_room_anywhere_all_are_candidates():
    assert names(_with_adapter([engine("a", {"y": 1, "z": 1}), engine("b", stats=False)], "x")) == ["b"]
    full = [engine("a", {"y": 1, "z": 1}), engine("b", {"v": 1, "w": 1})]
    assert names(_with_adapter(full, "x")) == ["a", "b"]
