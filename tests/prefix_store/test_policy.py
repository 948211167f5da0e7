"""The routing policy: longest prefix wins unless its engine is overloaded; least-loaded else."""

from __future__ import annotations

import pytest

from prefix_store import EngineLoad, RoutingConfig, RoutingPolicy


def idle(engine_id: str) -> EngineLoad:
    return EngineLoad(engine_id, kv_blocks_total=100, kv_blocks_free=100)


def test_the_longest_prefix_wins_among_idle_engines():
    policy = RoutingPolicy()
    loads = [idle("a"), idle("b"), idle("c")]
    decision = policy.choose(loads, {"a": 3, "b": 10, "c": 0}, num_blocks=12)
    assert (decision.engine_id, decision.reason, decision.matched_blocks) == ("b", "prefix", 10)


def test_an_overloaded_engine_loses_its_prefix_to_the_next_best():
    policy = RoutingPolicy(RoutingConfig(max_waiting=4))
    queued = EngineLoad("b", requests_waiting=4, kv_blocks_total=100, kv_blocks_free=90)
    loads = [idle("a"), queued, idle("c")]
    assert policy.choose(loads, {"a": 3, "b": 10, "c": 0}, 12).engine_id == "a"
    full_kv = EngineLoad("b", kv_blocks_total=100, kv_blocks_free=1)
    assert policy.choose([idle("a"), full_kv], {"a": 3, "b": 10}, 12).engine_id == "a"


def test_a_small_prefix_does_not_outweigh_a_heavy_load():
    policy = RoutingPolicy()
    busy = EngineLoad("a", requests_running=20, requests_waiting=3, kv_blocks_total=100, kv_blocks_free=40)
    decision = policy.choose([busy, idle("b")], {"a": 2, "b": 0}, num_blocks=10)
    assert (decision.engine_id, decision.reason) == ("b", "load")
    # A long prefix is worth more than the same load.
    assert policy.choose([busy, idle("b")], {"a": 64, "b": 0}, num_blocks=66).engine_id == "a"


def test_without_the_index_the_least_loaded_engine_wins():
    policy = RoutingPolicy()
    loads = [EngineLoad("a", requests_running=5), EngineLoad("b", requests_running=1),
             EngineLoad("c", requests_waiting=1)]
    decision = policy.choose(loads, None, num_blocks=10)
    assert (decision.engine_id, decision.reason, decision.matched_blocks) == ("b", "fallback", 0)


def test_when_all_are_overloaded_the_least_loaded_still_gets_the_request():
    policy = RoutingPolicy(RoutingConfig(max_waiting=2))
    loads = [EngineLoad("a", requests_waiting=9), EngineLoad("b", requests_waiting=3)]
    assert policy.choose(loads, {"a": 5}, 5).engine_id == "b"


def test_ties_rotate_so_equal_engines_share_the_work():
    policy = RoutingPolicy()
    loads = [idle("a"), idle("b"), idle("c")]
    picks = [policy.choose(loads, {}, 4).engine_id for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]
    assert {policy.choose(loads, {}, 4).reason for _ in range(3)} == {"load"}


def test_engines_unknown_to_the_index_count_as_holding_nothing():
    policy = RoutingPolicy()
    decision = policy.choose([idle("new")], {"gone": 7}, 7)
    assert (decision.engine_id, decision.matched_blocks, decision.reason) == ("new", 0, "load")


def test_kv_usage_is_the_share_of_blocks_in_use_and_bad_config_is_refused():
    load = EngineLoad("e", requests_running=2, requests_waiting=1, kv_blocks_total=200, kv_blocks_free=50)
    assert load.kv_usage == 0.75
    assert EngineLoad("new").kv_usage == 0.0   # no stats yet: nothing in use
    with pytest.raises(ValueError):
        RoutingPolicy().choose([], {}, 1)
    for bad in ({"max_waiting": 0}, {"max_kv_usage": 0.0}, {"running_cost_blocks": -1.0}):
        with pytest.raises(ValueError):
            RoutingConfig(**bad)
