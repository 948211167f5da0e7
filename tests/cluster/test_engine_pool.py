"""EnginePool in one process: discovery through a registry, and requests continued on another
engine when theirs stops, against scripted engines whose next token depends on every token
before it (so a continuation is right only if it carries exactly the tokens already sent)."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.messages.front_end import (
    AbortRequest, EngineInfo, EngineStats, GetEngineInfo, GetStats, SamplingParams, SubmitRequest,
    TokenDelta, TokenDeltas,
)
from gateway.engine_client import EngineLost, RequestFailed
from gateway.engine_pool import EnginePool, PoolConfig
from prefix_store import PrefixRouter
from runtime import Actor, ActorSystem, InMemoryRegistry


def next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) + len(tokens)) % 997


def expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class _Tick:
    pass


class ScriptedEngine(Actor):
    """One token per request every tick, like a decode step."""

    def __init__(self, engine_id: str):
        self.info = EngineInfo(engine_id, 4096, 16, "scripted")
        self.running: dict[str, list] = {}
        self.served: list[str] = []
        self.pulls: list = []   # each request's pull_from
        self.stats = EngineStats(0, 0, 100, 100, 0, 0, 0, 0, 0)

    async def on_start(self) -> None:
        self.context.schedule_repeating(0.005, _Tick())

    async def receive(self, msg):
        match msg:
            case GetEngineInfo():
                return self.info
            case GetStats():
                return msgspec.structs.replace(self.stats, requests_running=len(self.running))
            case SubmitRequest():
                self.served.append(msg.request_id)
                self.pulls.append(msg.pull_from)
                self.running[msg.request_id] = [list(msg.prompt_token_ids), msg.params.max_tokens, msg.reply_to,
                                                len(msg.prompt_token_ids)]
            case AbortRequest(request_id=rid):
                self.running.pop(rid, None)
            case _Tick():
                for rid, (tokens, left, reply_to, n_prompt) in list(self.running.items()):
                    tokens.append(next_token(tokens))
                    left -= 1
                    done = "length" if left == 0 else None
                    reply_to.tell(TokenDeltas([TokenDelta(rid, 0, [tokens[-1]], None, done, n_prompt, 0)]))
                    if done:
                        del self.running[rid]
                    else:
                        self.running[rid][1] = left


async def _cluster(max_migrations: int = 3, router: PrefixRouter | None = None, **pool_config):
    """Two scripted engines; with a router, routed by prefix, each its own KV receiver (one layout)."""
    registry = InMemoryRegistry()
    system = ActorSystem("pool-test", registry=registry)
    await system.start()
    engines = {}
    for name in ("a", "b"):
        actor = ScriptedEngine(name)
        ref = await system.spawn(actor, name=f"front-{name}")
        if router is not None:
            actor.info = msgspec.structs.replace(actor.info, kv_receiver=ref, kv_layout="same")
        await system.publish(f"engines/{name}", ref)
        engines[name] = (actor, ref)
    pool = EnginePool(system, registry, router or PrefixRouter(None),
                      PoolConfig(**{"routing": "least_loaded" if router is None else "kv", "discovery_interval_s": 0.05,
                                    "stats_interval_s": 0.05, "max_migrations": max_migrations,
                                    "no_engine_wait_s": 2.0, **pool_config}))
    await pool.start()
    async with asyncio.timeout(5):
        while len(pool.engines) < 2:
            await asyncio.sleep(0.01)
    return system, pool, engines


async def _collect(queue: asyncio.Queue, until_tokens: int | None = None, on_count=None) -> list:
    items = []
    async with asyncio.timeout(10):
        while True:
            item = await queue.get()
            items.append(item)
            if isinstance(item, EngineLost) or item.finish_reason is not None:
                return items
            if on_count is not None:
                await on_count(sum(len(i.token_ids) for i in items))


async def test_a_request_continues_on_another_engine_with_the_same_tokens():
    system, pool, engines = await _cluster()
    try:
        prompt = [11, 22, 33]
        queue: asyncio.Queue = asyncio.Queue()
        pool.submit("r1", prompt, SamplingParams(max_tokens=30, temperature=0.0), queue)
        stopped = []

        async def kill_after(n: int) -> None:
            if n >= 8 and not stopped:
                holder = next(name for name, (actor, _) in engines.items() if "r1" in actor.running)
                stopped.append(holder)
                await system.stop(engines[holder][1])

        items = await _collect(queue, on_count=kill_after)
        tokens = [t for d in items for t in d.token_ids]
        assert tokens == expected(prompt, 30)
        assert items[-1].finish_reason == "length"
        assert all(d.request_id == "r1" and d.num_prompt_tokens == 3 for d in items)
        assert pool.metrics.migrations == 1
        other = "b" if stopped[0] == "a" else "a"
        assert any(rid.startswith("r1@") for rid in engines[other][0].served)
    finally:
        await pool.close()
        await system.shutdown()


async def test_past_the_migration_cap_the_stream_ends_with_an_error():
    system, pool, engines = await _cluster(max_migrations=0)
    try:
        queue: asyncio.Queue = asyncio.Queue()
        pool.submit("r2", [5], SamplingParams(max_tokens=50), queue)

        async def kill_after(n: int) -> None:
            if n == 3:
                for actor, ref in engines.values():
                    if "r2" in actor.running:
                        await system.stop(ref)

        items = await _collect(queue, on_count=kill_after)
        assert isinstance(items[-1], EngineLost)
    finally:
        await pool.close()
        await system.shutdown()


async def test_an_aborted_request_stops_on_its_engine_and_is_forgotten():
    system, pool, engines = await _cluster()
    try:
        queue: asyncio.Queue = asyncio.Queue()
        pool.submit("r3", [7, 7], SamplingParams(max_tokens=1000), queue)
        await queue.get()
        pool.abort("r3")
        pool.release("r3")
        await asyncio.sleep(0.05)
        assert all("r3" not in actor.running for actor, _ in engines.values())
        assert pool.num_open == 0
    finally:
        await pool.close()
        await system.shutdown()


@pytest.mark.parametrize("routing", ["round_robin", "least_loaded"])
async def test_requests_spread_over_the_engines(routing):
    system, pool, engines = await _cluster()
    pool.config.routing = routing
    try:
        queues = []
        for i in range(6):
            q: asyncio.Queue = asyncio.Queue()
            pool.submit(f"s{i}", [i + 1], SamplingParams(max_tokens=3), q)
            queues.append(q)
        for q in queues:
            await _collect(q)
        assert all(len(actor.served) >= 2 for actor, _ in engines.values())
    finally:
        await pool.close()
        await system.shutdown()


async def test_a_request_that_cannot_be_sent_fails_instead_of_hanging():
    """Over a real connection: a SubmitRequest that cannot be encoded (a priority past 64 bits) or
    framed (over the frame cap) fails its request at once, and the pool keeps serving."""
    registry = InMemoryRegistry()
    engine_node = ActorSystem("engine-node", listen=0, secret="s3cret", registry=registry)
    await engine_node.start()
    gateway = ActorSystem("gateway-node", secret="s3cret", registry=registry, max_frame_bytes=4096)
    await gateway.start()
    await engine_node.publish("engines/remote", await engine_node.spawn(ScriptedEngine("remote"), name="front"))
    pool = EnginePool(gateway, registry, PrefixRouter(None),
                      PoolConfig(routing="least_loaded", discovery_interval_s=0.05, stats_interval_s=0.05))
    await pool.start()
    try:
        async with asyncio.timeout(5):
            while not pool.engines:
                await asyncio.sleep(0.01)
        for rid, prompt, priority in (("huge-priority", [1, 2], 2 ** 64), ("huge-prompt", [1] * 5000, 0)):
            queue: asyncio.Queue = asyncio.Queue()
            pool.submit(rid, prompt, SamplingParams(max_tokens=2), queue, priority)
            failed = await asyncio.wait_for(queue.get(), 5)
            assert isinstance(failed, RequestFailed), failed
            assert "could not be sent" in str(failed)
            pool.release(rid)
        queue = asyncio.Queue()
        pool.submit("fine", [4, 5], SamplingParams(max_tokens=3), queue)
        assert [t for d in await _collect(queue) for t in d.token_ids] == expected([4, 5], 3)
    finally:
        await pool.close()
        await gateway.shutdown()
        await engine_node.shutdown()


async def test_each_engine_keeps_its_own_stats_and_none_are_summed():
    system, pool, engines = await _cluster()
    try:
        engines["a"][0].stats = EngineStats(1, 0, 100, 40, 0, 0, 0, 7, 0, steps=10)
        engines["b"][0].stats = EngineStats(2, 3, 100, 60, 0, 0, 0, 9, 0, steps=30)
        async with asyncio.timeout(5):
            while any(e.stats is None or e.stats.steps == 0 for e in pool.engines.values()):
                await asyncio.sleep(0.01)
        stats = await pool.engine_stats()
        assert sorted(stats) == ["a", "b"]
        assert (stats["a"].generation_tokens, stats["a"].kv_blocks_free, stats["a"].steps) == (7, 40, 10)
        assert (stats["b"].generation_tokens, stats["b"].requests_waiting, stats["b"].steps) == (9, 3, 30)
    finally:
        await pool.close()
        await system.shutdown()


async def test_a_busy_engine_holding_the_prefix_is_named_for_the_chosen_one_to_pull_from():
    from prefix_store import InMemoryPrefixStore, hash_full_blocks

    store = InMemoryPrefixStore()
    system, pool, engines = await _cluster(router=PrefixRouter(store, timeout_s=1.0))
    try:
        prompt = list(range(100, 180))   # five full blocks
        await store.publish_snapshot("a", hash_full_blocks(prompt, 16), 0)
        await store.publish_snapshot("b", [], 0)
        engines["a"][0].stats = msgspec.structs.replace(engines["a"][0].stats, requests_waiting=10)
        await asyncio.sleep(0.2)   # the pool hears a's queue
        q: asyncio.Queue = asyncio.Queue()
        pool.submit("p1", prompt, SamplingParams(max_tokens=2), q)
        await _collect(q)
        assert engines["b"][0].served == ["p1"] and engines["b"][0].pulls == [engines["a"][1]]
    finally:
        await pool.close()
        await system.shutdown()


@pytest.mark.parametrize("routing", ["kv", "least_loaded", "round_robin"])
@pytest.mark.parametrize("prefix_pull", [True, False])
async def test_whatever_chose_the_engine_the_holder_is_named_to_pull_from_unless_pulls_are_off(routing, prefix_pull):
    """By load or in turn the prompt goes to b although a holds its prefix, and (with pulls on) a is
    named to pull from; with pulls off no routing names one."""
    from prefix_store import InMemoryPrefixStore, hash_full_blocks

    store = InMemoryPrefixStore()
    system, pool, engines = await _cluster(router=PrefixRouter(store, timeout_s=1.0), routing=routing,
                                           prefix_pull=prefix_pull)
    try:
        prompt = list(range(100, 180))   # five full blocks
        await store.publish_snapshot("a", hash_full_blocks(prompt, 16), 0)
        await store.publish_snapshot("b", [], 0)
        waiting = 10 if routing == "kv" else 1   # by prefix only a long queue outweighs five blocks
        engines["a"][0].stats = msgspec.structs.replace(engines["a"][0].stats, requests_waiting=waiting)
        await asyncio.sleep(0.2)   # the pool hears a's queue
        for rid in ("p1", "p2"):   # in turn: a, then b
            q: asyncio.Queue = asyncio.Queue()
            pool.submit(rid, prompt, SamplingParams(max_tokens=2), q)
            await _collect(q)
        served_b = {"round_robin": ["p2"]}.get(routing, ["p1", "p2"])
        assert engines["b"][0].served == served_b
        assert engines["b"][0].pulls == [engines["a"][1] if prefix_pull else None] * len(served_b)
    finally:
        await pool.close()
        await system.shutdown()


class HeldStatsEngine(ScriptedEngine):
    """Answers each GetStats only once the test lets it: a stats reply on its way while requests are sent."""

    def __init__(self, engine_id: str):
        super().__init__(engine_id)
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    async def receive(self, msg):
        if isinstance(msg, GetStats):
            self.asked.set()
            await self.answer.wait()
            self.answer, self.asked = asyncio.Event(), asyncio.Event()   # the next one waits again
        return await super().receive(msg)


async def test_a_request_sent_while_the_stats_were_asked_still_counts_once_they_come():
    """The stats' reply does not count a request sent after its ask: the pool keeps counting that request as
    waiting, or a burst of routes would see an idle engine it has just sent work to."""
    registry = InMemoryRegistry()
    system = ActorSystem("pool-test", registry=registry)
    await system.start()
    held, busy = HeldStatsEngine("held"), ScriptedEngine("busy")
    busy.stats = msgspec.structs.replace(busy.stats, requests_waiting=10)   # least-loaded routing avoids it
    for name, actor in (("held", held), ("busy", busy)):
        await system.publish(f"engines/{name}", await system.spawn(actor, name=f"front-{name}"))
    pool = EnginePool(system, registry, PrefixRouter(None),
                      PoolConfig(routing="least_loaded", discovery_interval_s=0.05, stats_interval_s=0.05))
    await pool.start()
    try:
        async with asyncio.timeout(5):
            while len(pool.engines) < 2:
                await asyncio.sleep(0.01)
            await held.asked.wait()
            engine = next(e for e in pool.engines.values() if e.info.engine_id == "held")
            asked_stats = engine.stats
            queue: asyncio.Queue = asyncio.Queue()
            pool.submit("r", [1, 2], SamplingParams(max_tokens=50), queue)
            while engine.sent == 0:
                await asyncio.sleep(0.001)
            held.answer.set()                           # the reply from before the request
            while engine.stats is asked_stats:
                await asyncio.sleep(0.001)
            assert engine.stats.requests_running == 0   # it had not reached the engine
            assert engine.load().requests_waiting == 1  # and is counted all the same
            held.answer.set()                           # the next reply has it running
            while engine.stats.requests_running == 0:
                await asyncio.sleep(0.001)
            assert engine.load().requests_waiting == 0
        pool.abort("r")
    finally:
        await pool.close()
        await system.shutdown()
