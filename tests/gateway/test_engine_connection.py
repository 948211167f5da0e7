"""One engine or a cluster: `EngineClient` and `EnginePool` are both the `EngineConnection` the
gateway holds, call for call (names, parameters, defaults, sync or async)."""
from __future__ import annotations

import inspect

import pytest

from actors.messages.front_end import EngineStats, GetStats
from gateway.engine_client import EngineClient
from gateway.engine_connection import EngineConnection
from gateway.engine_pool import EnginePool
from prefix_store import PrefixRouter
from runtime import Actor, ActorSystem, InMemoryRegistry

MEMBERS = [name for name in dir(EngineConnection) if not name.startswith("_")]


def test_the_protocol_names_what_the_gateway_calls():
    assert sorted(MEMBERS) == ["abort", "alive", "engine_stats", "manage_lora", "release", "submit"]


@pytest.mark.parametrize("cls", [EngineClient, EnginePool], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", MEMBERS)
def test_each_call_has_the_protocols_signature(cls, name):
    wanted, got = getattr(EngineConnection, name), getattr(cls, name, None)
    assert got is not None, f"{cls.__name__} has no {name}"
    if isinstance(wanted, property):
        assert isinstance(got, property), f"{cls.__name__}.{name} is not a property"
        assert inspect.signature(got.fget).return_annotation == inspect.signature(wanted.fget).return_annotation
        return
    assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(wanted), name
    want, have = inspect.signature(wanted), inspect.signature(got)
    params = list(have.parameters.values())
    # The protocol's parameters first, as it names them; any more must be optional.
    for w, h in zip(want.parameters.values(), params):
        assert (h.name, h.kind, h.default, h.annotation) == (w.name, w.kind, w.default, w.annotation), \
            f"{cls.__name__}.{name}: {have} against {want}"
    assert len(params) >= len(want.parameters), f"{cls.__name__}.{name}: {have} against {want}"
    for extra in params[len(want.parameters):]:
        assert extra.default is not inspect.Parameter.empty, f"{cls.__name__}.{name}: {extra} is required"
    assert have.return_annotation == want.return_annotation, f"{cls.__name__}.{name}"


class StatsOnly(Actor):
    async def receive(self, msg):
        match msg:
            case GetStats():
                return EngineStats(0, 0, 100, 100, 0, 0, 0, 0, 0)


async def test_real_instances_are_engine_connections():
    registry = InMemoryRegistry()
    system = ActorSystem("connection-test", registry=registry)
    await system.start()
    try:
        client = await EngineClient.start(system, await system.spawn(StatsOnly(), name="scheduler"))
        pool = EnginePool(system, registry, PrefixRouter(None))
        for conn in (client, pool):
            assert isinstance(conn, EngineConnection)
        assert client.alive and list(await client.engine_stats()) == ["0"]
        assert not pool.alive and await pool.engine_stats() == {}   # no engine found yet
    finally:
        await system.shutdown()
