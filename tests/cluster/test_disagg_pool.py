"""EnginePool with prefill and decode engines, in one process against scripted engines: a request
goes to the prefill engine naming a decode engine, streams its first token from there and the
rest from the decode engine; a decode engine that refuses (its pool is full) is passed over for
another, and with none that has room the request waits for one instead of failing; a short prompt
runs whole on the decode engine; a decode engine whose KV layout no prefill engine shares gets no
handoffs."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.messages.front_end import (
    EngineInfo, EngineStats, GetEngineInfo, GetStats, SamplingParams, SubmitRequest, TokenDelta, TokenDeltas,
)
from actors.messages.handoff import HandoffDone, HandoffFailed, HandoffOffer, HandoffOfferReply
from gateway.engine_pool import EnginePool, PoolConfig
from prefix_store import PrefixRouter
from runtime import Actor, ActorSystem, InMemoryRegistry
from tests.cluster.test_engine_pool import expected, next_token


def _stats(running: int = 0, free: int = 100) -> EngineStats:
    return EngineStats(running, 0, 100, free, 0, 0, 0, 0, 0)


class ScriptedDecode(Actor):
    """Takes a handoff when it has room and decodes the rest at once, one delta per token."""

    def __init__(self, engine_id: str, room: bool, stats: EngineStats, kv_layout: str = "layout"):
        self.engine_id, self.room, self.stats, self.kv_layout = engine_id, room, stats, kv_layout
        self.offers: list[str] = []
        self.served: list[SubmitRequest] = []

    async def receive(self, msg):
        match msg:
            case SubmitRequest():   # a short prompt, prefilled here
                self.served.append(msg)
                tokens = list(msg.prompt_token_ids)
                for left in range(msg.params.max_tokens, 0, -1):
                    tokens.append(next_token(tokens))
                    msg.reply_to.tell(TokenDeltas([TokenDelta(msg.request_id, 0, [tokens[-1]], None,
                                                              "length" if left == 1 else None,
                                                              len(msg.prompt_token_ids), 0)]))
            case GetEngineInfo():
                return EngineInfo(self.engine_id, 4096, 16, "scripted", role="decode",
                                  kv_receiver=self.context.self_ref, kv_layout=self.kv_layout)
            case GetStats():
                return self.stats
            case HandoffOffer():
                self.offers.append(msg.request_id)
                if not self.room:   # as its next stats will say
                    self.stats = msgspec.structs.replace(self.stats, kv_blocks_free=0)
                    return HandoffOfferReply(False, reason="full", no_room=True)
                msg.reply_to.tell(HandoffDone(msg.request_id))
                tokens = msg.prompt_token_ids + msg.output_token_ids
                for left in range(msg.params.max_tokens - len(msg.output_token_ids), 0, -1):
                    tokens.append(next_token(tokens))
                    msg.reply_to.tell(TokenDeltas([TokenDelta(msg.request_id, 0, [tokens[-1]], None,
                                                              "length" if left == 1 else None,
                                                              len(msg.prompt_token_ids), 0)]))
                return HandoffOfferReply(True)
            case _:
                return None


class ScriptedPrefill(Actor):
    """Samples the first token, then offers the request to the decode engine it was told of."""

    def __init__(self):
        self.served: list[SubmitRequest] = []

    async def receive(self, msg):
        match msg:
            case GetEngineInfo():
                return EngineInfo("prefill", 4096, 16, "scripted", role="prefill", kv_layout="layout")
            case GetStats():
                return _stats()
            case SubmitRequest():
                self.served.append(msg)
                first = next_token(msg.prompt_token_ids)
                whole = msg.handoff_to is None   # served here alone: one token is all it asks below
                msg.reply_to.tell(TokenDeltas([TokenDelta(msg.request_id, 0, [first], None,
                                                          "length" if whole else None,
                                                          len(msg.prompt_token_ids), 0)]))
                if whole:
                    return
                offer = HandoffOffer("t", self.context.self_ref, msg.request_id, msg.prompt_token_ids, [first],
                                msg.params, msg.reply_to, 0, None, 0, "layout")
                reply = await msg.handoff_to.ask(offer)
                if not reply.accepted:
                    msg.reply_to.tell(HandoffFailed(msg.request_id, reply.reason, reply.no_room))
            case _:
                return None


async def _cluster(decodes: dict[str, ScriptedDecode], local_prefill_tokens: int = 0):
    registry = InMemoryRegistry()
    system = ActorSystem("disagg-pool-test", registry=registry)
    await system.start()
    prefill = ScriptedPrefill()
    await system.publish("engines/prefill/p", await system.spawn(prefill, name="front-p"))
    for name, actor in decodes.items():
        await system.publish(f"engines/decode/{name}", await system.spawn(actor, name=f"front-{name}"))
    pool = EnginePool(system, registry, PrefixRouter(None),
                      PoolConfig(routing="least_loaded", discovery_interval_s=0.05, stats_interval_s=0.05,
                                 no_engine_wait_s=3.0, local_prefill_tokens=local_prefill_tokens))
    await pool.start()
    async with asyncio.timeout(5):
        while len(pool.engines) < 1 + len(decodes) or any(e.stats is None for e in pool.engines.values()):
            await asyncio.sleep(0.01)
    return system, pool, prefill


async def _tokens(queue: asyncio.Queue) -> list[int]:
    out = []
    async with asyncio.timeout(5):
        while True:
            d = await queue.get()
            assert isinstance(d, TokenDelta), d
            out += d.token_ids
            if d.finish_reason is not None:
                return out


async def test_a_full_decode_engine_is_passed_over_for_one_with_room():
    full = ScriptedDecode("d1", room=False, stats=_stats(running=0))   # its stats said it had room
    roomy = ScriptedDecode("d2", room=True, stats=_stats(running=3))   # busier: chosen second
    system, pool, prefill = await _cluster({"d1": full, "d2": roomy})
    try:
        queue: asyncio.Queue = asyncio.Queue()
        prompt = [3, 1, 4, 1, 5]
        pool.submit("r", prompt, SamplingParams(max_tokens=6, temperature=0.0), queue)
        assert await _tokens(queue) == expected(prompt, 6)
        assert full.offers == ["r"] and len(roomy.offers) == 1 and roomy.offers[0].startswith("r@")
        # The continuation carried the first token, and went to the prefill engine again.
        assert [len(s.prompt_token_ids) for s in prefill.served] == [5, 6]
        assert pool.metrics.handoffs == 1 and pool.metrics.migrations == 0
    finally:
        await pool.close()
        await system.shutdown()


async def test_with_every_decode_engine_full_a_request_waits_for_room():
    decode = ScriptedDecode("d1", room=True, stats=_stats(free=0))
    system, pool, prefill = await _cluster({"d1": decode})
    try:
        queue: asyncio.Queue = asyncio.Queue()
        pool.submit("w", [2, 7], SamplingParams(max_tokens=4, temperature=0.0), queue)
        await asyncio.sleep(0.5)   # several stats rounds: still no room, nothing sent
        assert not prefill.served and queue.empty()
        decode.stats = msgspec.structs.replace(decode.stats, kv_blocks_free=50)
        assert await _tokens(queue) == expected([2, 7], 4)
        assert prefill.served[0].handoff_to is not None
    finally:
        await pool.close()
        await system.shutdown()


async def test_requests_that_need_their_prompt_forward_run_whole_on_the_prefill_engine():
    decode = ScriptedDecode("d1", room=True, stats=_stats())
    system, pool, prefill = await _cluster({"d1": decode})
    try:
        queue: asyncio.Queue = asyncio.Queue()
        pool.submit("lp", [4, 4], SamplingParams(max_tokens=1, prompt_logprobs=1), queue)
        assert await _tokens(queue) == expected([4, 4], 1)
        assert prefill.served[0].handoff_to is None and not decode.offers
    finally:
        await pool.close()
        await system.shutdown()


async def test_a_short_prompt_runs_whole_on_the_decode_engine_and_a_longer_one_is_handed_over():
    decode = ScriptedDecode("d1", room=True, stats=_stats())
    system, pool, prefill = await _cluster({"d1": decode}, local_prefill_tokens=4)
    try:
        short, longer = [5, 3, 2, 9], [5, 3, 2, 9, 8]
        for rid, prompt in (("s", short), ("l", longer)):
            queue: asyncio.Queue = asyncio.Queue()
            pool.submit(rid, prompt, SamplingParams(max_tokens=5, temperature=0.0), queue)
            assert await _tokens(queue) == expected(prompt, 5)
        assert [(m.prompt_token_ids, m.handoff_to) for m in decode.served] == [(short, None)]
        assert [m.prompt_token_ids for m in prefill.served] == [longer] and decode.offers == ["l"]
        assert pool.metrics.handoffs == 1
    finally:
        await pool.close()
        await system.shutdown()


async def test_handoffs_go_only_to_a_decode_engine_of_the_prefill_engines_kv_layout():
    # `--dtype auto` resolved to float32 on one engine and bfloat16 on the other: the idle one cannot
    # take the prefill engine's blocks, so the busier one of its layout gets the request.
    other = ScriptedDecode("d1", room=True, stats=_stats(running=0), kv_layout="30x(float32)")
    same = ScriptedDecode("d2", room=True, stats=_stats(running=5))
    system, pool, prefill = await _cluster({"d1": other, "d2": same})
    try:
        for rid in ("a", "b"):
            queue: asyncio.Queue = asyncio.Queue()
            pool.submit(rid, [6, 2, 8], SamplingParams(max_tokens=4, temperature=0.0), queue)
            assert await _tokens(queue) == expected([6, 2, 8], 4)
        assert same.offers == ["a", "b"] and not other.offers and not other.served
        assert pool.metrics.handoffs == 2 and pool.metrics.handoff_failures == 0
    finally:
        await pool.close()
        await system.shutdown()


async def test_with_no_decode_engine_of_its_kv_layout_a_request_runs_whole():
    other = ScriptedDecode("d1", room=True, stats=_stats(), kv_layout="30x(float32)")
    system, pool, prefill = await _cluster({"d1": other})
    try:
        queue: asyncio.Queue = asyncio.Queue()
        pool.submit("w", [1, 6, 1, 8], SamplingParams(max_tokens=1, temperature=0.0), queue)
        assert await _tokens(queue) == expected([1, 6, 1, 8], 1)
        assert not other.offers   # nothing was offered that the engine must refuse
        assert [m.handoff_to for m in prefill.served + other.served] == [None]
    finally:
        await pool.close()
        await system.shutdown()


def test_a_negative_local_prefill_length_is_refused():
    with pytest.raises(ValueError, match="local_prefill_tokens"):
        PoolConfig(local_prefill_tokens=-1)
