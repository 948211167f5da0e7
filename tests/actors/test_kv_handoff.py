"""KV handoff between two engines in one process, through their transfer actors' messages: the
decode engine's greedy tokens equal a colocated run's and it runs no prefill for them; a full
decode engine refuses; a sender that dies halfway leaves no blocks taken; a slow receiver holds
the sender to its window; the block bytes survive the trip; and reserved blocks serve no prefix
hit before their KV is in."""
from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
import torch

from actors.config import EngineConfig
from actors.engine import start_engine
from actors.nodes.engine_node import attach_kv_transfer
from actors.kv.transfer import KVTransfer, KVTransferConfig
from actors.messages.front_end import GetStats, SamplingParams, SubmitRequest, TokenDeltas
from actors.messages.handoff import (
    HandoffSend, HandoffSendAhead, HandoffWithdraw, HandoffSent, HandoffSendLayers, HandoffCancel, HandoffChunk, HandoffCommit,
    HandoffDone, HandoffFailed, HandoffOffer, HandoffOfferReply,
)
from actors.messages.kv import GetKVStats
from actors.messages.step import LayerWritten
from actors.worker.kv_blocks import KVBlockIO
from actors.worker.model import LayerKV
from runtime import Actor, ActorSystem
from tests.actors.waiting import wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class Front(Actor):
    """What a gateway hears: deltas, handovers and failed handoffs."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.handed_over: list[str] = []
        self.failed: list[HandoffFailed] = []
        self.changed = asyncio.Event()

    async def receive(self, msg):
        match msg:
            case TokenDeltas(deltas=deltas):
                for d in deltas:
                    self.tokens.setdefault(d.request_id, []).extend(d.token_ids)
                    if d.finish_reason is not None:
                        self.finished.add(d.request_id)
            case HandoffDone(request_id=rid):
                self.handed_over.append(rid)
            case HandoffFailed():
                self.failed.append(msg)
        self.changed.set()

    async def wait(self, pred, timeout=60.0):
        await wait_until(self.changed, pred, timeout)


def _config(model: str, num_blocks: int, kv_cache_dtype: str = "auto") -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", num_threads=1, block_size=16, num_blocks=num_blocks,
                        max_num_batched_tokens=128, kv_cache_dtype=kv_cache_dtype)


@pytest.fixture(params=["auto", "int8"])
async def pair(tiny_model_dir, request):
    """A prefill and a decode engine, each with its transfer actor, and a small window; the cache in
    the model's dtype, or int8 (its scales travel with the blocks)."""
    model = tiny_model_dir("llama")
    system = ActorSystem("handoff-test")
    await system.start()
    prefill = await start_engine(_config(model, 96, request.param), system, name="pre")
    decode = await start_engine(_config(model, 24, request.param), system, name="dec")
    config = KVTransferConfig(window_bytes=2 * prefill.kv_blocks.bytes_per_block,
                              chunk_bytes=prefill.kv_blocks.bytes_per_block)
    pre_tx = await attach_kv_transfer(system, prefill, config, name="pre")
    dec_tx = await attach_kv_transfer(system, decode, config, name="dec")
    front = Front()
    front_ref = await system.spawn(front, name="front")
    yield system, prefill, decode, dec_tx, front, front_ref
    for ref in (pre_tx, dec_tx):
        await system.stop(ref)
    await prefill.stop()
    await decode.stop()
    await system.shutdown()


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    shared = [rng.randrange(4, 300) for _ in range(40)]
    return [[rng.randrange(4, 300) for _ in range(n)] for n in (3, 16, 37, 70)] + \
        [shared + [5, 6], shared + [7, 8, 9]]   # the second finds the first's blocks on both engines


async def _run(engine, front_ref, front, prompts, tag, handoff_to=None):
    for i, p in enumerate(prompts):
        engine.scheduler.tell(SubmitRequest(f"{tag}{i}", p, GREEDY, front_ref, handoff_to=handoff_to))
        await front.wait(lambda: f"{tag}{i}" in front.finished)   # one by one: the second prompt's hit
    return [front.tokens[f"{tag}{i}"] for i in range(len(prompts))]


async def test_a_handed_over_request_decodes_the_colocated_tokens_without_a_prefill_there(pair):
    system, prefill, decode, dec_tx, front, front_ref = pair
    prompts = _prompts()
    colocated = await _run(prefill, front_ref, front, prompts, "c")
    before = await prefill.scheduler.ask(GetStats())
    handed = await _run(prefill, front_ref, front, prompts, "d", handoff_to=dec_tx)
    assert handed == colocated
    assert front.handed_over == [f"d{i}" for i in range(len(prompts))] and not front.failed
    d = await decode.scheduler.ask(GetStats())
    assert d.prefill_steps == 0 and d.prefill_tokens == 0
    assert d.kv_handoffs_received == len(prompts) and d.generation_tokens == len(prompts) * (GREEDY.max_tokens - 1)
    p = await prefill.scheduler.ask(GetStats())
    assert p.kv_handoffs_sent == len(prompts) and p.kv_handoffs_failed == 0
    assert p.generation_tokens - before.generation_tokens == len(prompts)   # the first token only
    # The repeated prompts found their leading blocks already on the decode engine: not sent again.
    total_blocks = sum(-(-len(q) // 16) for q in prompts)
    assert 0 < p.kv_transfer_blocks < total_blocks
    assert p.kv_transfer_bytes == p.kv_transfer_blocks * prefill.kv_blocks.bytes_per_block
    assert p.ttft_count == 2 * len(prompts) and p.ttft_prefill_s > 0
    await front.wait(lambda: True)
    kv = await prefill.kv.ask(GetKVStats())
    assert kv.num_free_blocks == kv.num_blocks   # every handed-over sequence gave its blocks back


async def test_a_full_decode_engine_refuses_and_the_prefill_engine_lets_go(pair):
    system, prefill, decode, dec_tx, front, front_ref = pair
    long = [random.Random(1).randrange(4, 300) for _ in range(30 * 16)]   # more blocks than it has
    prefill.scheduler.tell(SubmitRequest("big", long, GREEDY, front_ref, handoff_to=dec_tx))
    await front.wait(lambda: front.failed)
    assert front.failed[0].refused and front.failed[0].request_id == "big"
    assert front.tokens["big"] and "big" not in front.finished   # its first token went out
    p = await prefill.scheduler.ask(GetStats())
    d = await decode.scheduler.ask(GetStats())
    # Refused twice: offered ahead after its first chunk (480 tokens, 128 a step), then whole once prefilled.
    assert p.kv_handoffs_failed == 1 and d.kv_handoffs_refused == 2
    kv = await prefill.kv.ask(GetKVStats())
    assert kv.num_free_blocks == kv.num_blocks


async def test_a_prompt_of_several_chunks_goes_ahead_and_decodes_the_colocated_tokens(pair):
    """Prompts of 3 and 2 chunks (128 tokens a step): their full blocks go while the next chunk is
    computed (how many go before the first token is out depends on timing; the protocol is pinned
    down below, with a recording receiver)."""
    system, prefill, decode, dec_tx, front, front_ref = pair
    rng = random.Random(6)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (300, 200)]
    colocated = await _run(prefill, front_ref, front, prompts, "c")
    handed = await _run(prefill, front_ref, front, prompts, "d", handoff_to=dec_tx)
    assert handed == colocated
    assert front.handed_over == ["d0", "d1"] and not front.failed
    d = await decode.scheduler.ask(GetStats())
    assert d.prefill_steps == 0 and d.kv_handoffs_received == 2
    p = await prefill.scheduler.ask(GetStats())
    assert p.kv_handoffs_sent == 2 and p.kv_transfer_blocks == -(-300 // 16) + -(-200 // 16)
    assert p.kv_transfer_blocks_ahead <= 256 // 16 + 128 // 16   # the blocks of every chunk but the last
    await front.wait(lambda: True)
    for engine in (prefill, decode):
        kv = await engine.kv.ask(GetKVStats())
        assert kv.num_free_blocks == kv.num_blocks


class HalfSender(Actor):
    """Offers a handoff and sends its first chunk only: a prefill engine that dies mid-transfer."""

    def __init__(self, to, chunk: HandoffChunk):
        self.to, self.chunk = to, chunk

    async def receive(self, offer: HandoffOffer):
        reply = await self.to.ask(msgspec.structs.replace(offer, sender=self.context.self_ref))
        assert reply.accepted
        return await self.to.ask(self.chunk)


async def test_a_handoff_cut_halfway_gives_the_decode_engine_its_blocks_back(pair):
    system, prefill, decode, dec_tx, front, front_ref = pair
    io = decode.kv_blocks
    prompt = [random.Random(2).randrange(4, 300) for _ in range(50)]   # 4 blocks
    ref = await system.spawn(HalfSender(dec_tx, HandoffChunk("cut", 0, 1, bytes(io.bytes_per_block))), name="half")
    free = (await decode.kv.ask(GetKVStats())).num_free_blocks
    assert await ref.ask(HandoffOffer("cut", ref, "half", prompt, [7], GREEDY, front_ref, 0, None, 0, io.layout)) == 1
    assert (await decode.kv.ask(GetKVStats())).num_free_blocks == free - 4   # reserved, one block written
    await system.stop(ref)   # the sender dies before it commits
    for _ in range(100):
        if (await decode.kv.ask(GetKVStats())).num_free_blocks == free:
            break
        await asyncio.sleep(0.02)
    assert (await decode.kv.ask(GetKVStats())).num_free_blocks == free
    assert not front.handed_over and "half" not in front.tokens
    stats = await decode.scheduler.ask(GetStats())
    assert stats.requests_running + stats.requests_waiting == 0 and stats.kv_handoffs_received == 0


async def test_a_request_that_fits_only_once_a_cut_handoff_lets_go_waits_for_it(pair):
    system, prefill, decode, dec_tx, front, front_ref = pair
    io = decode.kv_blocks
    rng = random.Random(8)
    held = [rng.randrange(4, 300) for _ in range(200)]   # 13 of the decode engine's 24 blocks
    prompt = [rng.randrange(4, 300) for _ in range(180)]   # 12 more, then one to grow into
    expected = await _run(prefill, front_ref, front, [prompt], "whole")
    ref = await system.spawn(HalfSender(dec_tx, HandoffChunk("held", 0, 1, bytes(io.bytes_per_block))), name="holder")
    assert await ref.ask(HandoffOffer("held", ref, "holder", held, [7], GREEDY, front_ref, 0, None, 0, io.layout)) == 1
    decode.scheduler.tell(SubmitRequest("late", prompt, GREEDY, front_ref))
    await asyncio.sleep(0.3)   # it does not fit beside the reservation: it waits, and does not fail
    assert "late" not in front.finished and not front.tokens.get("late")
    await system.stop(ref)   # the sender dies: its reservation goes, the request runs
    await front.wait(lambda: "late" in front.finished)
    assert front.tokens["late"] == expected[0]


class SlowReceiver(Actor):
    """Accepts an offer, then takes its time over every chunk: a decode engine that lags."""

    def __init__(self):
        self.blocks: list[int] = []

    async def receive(self, msg):
        match msg:
            case HandoffOffer():
                return HandoffOfferReply(True)
            case HandoffChunk():
                await asyncio.sleep(0.02)
                self.blocks.append(msg.first_block)
                return msg.num_blocks
            case HandoffCommit():
                return True


async def _sender(system: ActorSystem, receiver_actor: Actor, config=None):
    """A KVTransfer over 2 layers of 12 blocks (4 tokens each) beside `receiver_actor`, with a scheduler
    that records its HandOverDones; `config(blocks)` is its config. Returns the transfer actor, its
    ref, the receiver's ref, the blocks, the scheduler's ref and the list of HandOverDones."""
    await system.start()
    blocks = KVBlockIO([(torch.randn(12, 4, 2, 8), torch.randn(12, 4, 2, 8)) for _ in range(2)])
    dones: list[HandoffSent] = []

    class Scheduler(Actor):
        async def receive(self, msg):
            if isinstance(msg, HandoffSent):
                dones.append(msg)

    sched = await system.spawn(Scheduler(), name="sched")
    receiver = await system.spawn(receiver_actor, name="receiver")
    tx_actor = KVTransfer(blocks, sched, 4, config(blocks) if config is not None else None)
    tx = await system.spawn(tx_actor, name="tx")
    return tx_actor, tx, receiver, blocks, sched, dones


async def _first_done(dones: list[HandoffSent], timeout: float = 5.0) -> HandoffSent:
    for _ in range(int(timeout / 0.02)):
        if dones:
            return dones[0]
        await asyncio.sleep(0.02)
    raise TimeoutError("no HandoffSent")


async def _hand_over_ten_blocks(system: ActorSystem, receiver_actor: Actor, config, transfer_id: str):
    """Blocks 0-9 of a 40-token request handed to `receiver_actor` whole; returns the transfer actor,
    its blocks and the HandoffSent its scheduler got."""
    tx_actor, tx, receiver, blocks, sched, dones = await _sender(system, receiver_actor, config)
    offer = HandoffOffer(transfer_id, tx, "r", list(range(40)), [1], GREEDY, sched, 0, None, 0, blocks.layout)
    tx.tell(HandoffSend(0, list(range(10)), offer, receiver))
    return tx_actor, blocks, await _first_done(dones)


async def test_a_slow_receiver_holds_the_sender_to_its_window():
    system = ActorSystem("window-test")
    receiver_actor = SlowReceiver()
    tx_actor, blocks, result = await _hand_over_ten_blocks(
        system, receiver_actor, lambda b: KVTransferConfig(window_bytes=3 * b.bytes_per_block,
                                                           chunk_bytes=b.bytes_per_block), "t1")
    assert result.ok and result.num_blocks == 10 and result.num_bytes == 10 * blocks.bytes_per_block
    assert receiver_actor.blocks == list(range(10))
    assert tx_actor.peak_in_flight_bytes == 3 * blocks.bytes_per_block   # full window, never more
    await system.shutdown()


class RecordingReceiver(Actor):
    """A decode engine reduced to what it hears: offers (refusing the first `refuse` of them),
    chunks, commits and cancels, in order."""

    def __init__(self, refuse: int = 0):
        self.refuse = refuse
        self.heard: list[tuple] = []
        self.changed = asyncio.Event()

    async def receive(self, msg):
        self.changed.set()
        match msg:
            case HandoffOffer():
                self.heard.append(("offer", list(msg.output_token_ids)))
                if self.refuse:
                    self.refuse -= 1
                    return HandoffOfferReply(False, reason="full", no_room=True)
                return HandoffOfferReply(True)
            case HandoffChunk():
                self.heard.append(("chunk", msg.first_block, msg.num_blocks, msg.first_layer, msg.num_layers))
                return msg.num_blocks
            case HandoffCommit():
                self.heard.append(("commit", msg.output_token_ids))
                return True
            case HandoffCancel():
                self.heard.append(("cancel",))

    def blocks(self) -> list[int]:
        return [b for e in self.heard if e[0] == "chunk" for b in range(e[1], e[1] + e[2])]

    def layers(self, num_layers: int) -> list[tuple[int, int]]:
        """(block, layer) of every chunk heard, in order (num_layers 0: a chunk of every layer)."""
        return [(b, layer) for e in self.heard if e[0] == "chunk" for b in range(e[1], e[1] + e[2])
                for layer in (range(e[3], e[3] + e[4]) if e[4] else range(num_layers))]


async def _ahead_pair(system: ActorSystem, receiver_actor: Actor):
    """A sender beside `receiver_actor` (two blocks a chunk) and a 40-token prompt's offer made ahead
    of its first token."""
    _, tx, receiver, blocks, sched, dones = await _sender(
        system, receiver_actor, lambda b: KVTransferConfig(chunk_bytes=2 * b.bytes_per_block))
    offer = HandoffOffer("ahead", tx, "r", list(range(40)), [], GREEDY, sched, 0, None, 0, blocks.layout)
    return tx, receiver, offer, dones


async def _heard(receiver: RecordingReceiver, pred) -> None:
    await wait_until(receiver.changed, pred, 5.0)


async def test_blocks_sent_ahead_go_as_they_are_ready_and_the_commit_brings_the_first_token():
    system = ActorSystem("ahead-test")
    rec = RecordingReceiver()
    tx, receiver, offer, dones = await _ahead_pair(system, rec)
    table = list(range(2, 12))
    tx.tell(HandoffSendAhead(7, table[:4], 4, offer, receiver))
    await _heard(rec, lambda: rec.blocks() == [0, 1, 2, 3])
    tx.tell(HandoffSendAhead(7, table[:8], 7, offer, receiver))
    await _heard(rec, lambda: rec.blocks() == list(range(7)))
    assert [e[0] for e in rec.heard] == ["offer", "chunk", "chunk", "chunk", "chunk"] and not dones
    final = msgspec.structs.replace(offer, transfer_id="whole", output_token_ids=[42])
    tx.tell(HandoffSend(7, table, final, receiver))
    await _first_done(dones)
    assert rec.heard[0] == ("offer", []) and rec.heard[-1] == ("commit", [42])
    assert rec.blocks() == list(range(10)) and sum(e[0] == "offer" for e in rec.heard) == 1
    assert dones[0].ok and dones[0].num_blocks == 10 and dones[0].num_blocks_ahead == 7
    await system.shutdown()


async def test_a_prompts_blocks_go_layer_by_layer_as_the_worker_writes_them_and_each_goes_once():
    """Two steps fill a 40-token prompt's 10 blocks (2 layers): the first blocks 0-3, the second 4-9 (the
    last partly). Each layer goes once written; the step's outcome sends only what is left."""
    system = ActorSystem("layers-test")
    rec = RecordingReceiver()
    tx, receiver, offer, dones = await _ahead_pair(system, rec)
    table = list(range(2, 12))
    tx.tell(HandoffSendLayers(7, 1, table, 0, 4, offer, receiver))
    tx.tell(LayerWritten(1, 0))
    await _heard(rec, lambda: rec.layers(2) == [(b, 0) for b in range(4)])
    tx.tell(LayerWritten(1, 1))
    await _heard(rec, lambda: len(rec.layers(2)) == 8)
    tx.tell(HandoffSendAhead(7, table, 4, offer, receiver))    # step 1 is over: blocks 0-3 are whole, and went
    tx.tell(HandoffSendLayers(7, 2, table, 4, 10, offer, receiver))
    tx.tell(LayerWritten(9, 0))                              # another step's: nothing of this handoff
    tx.tell(LayerWritten(2, 0))
    await _heard(rec, lambda: len(rec.layers(2)) == 14)
    assert sorted(rec.layers(2)[8:]) == [(b, 0) for b in range(4, 10)] and not dones
    tx.tell(HandoffSend(7, table, msgspec.structs.replace(offer, transfer_id="whole", output_token_ids=[42]), receiver))
    done = await _first_done(dones)
    sent = rec.layers(2)
    assert sorted(sent) == [(b, layer) for b in range(10) for layer in range(2)]   # every one, once
    assert set(sent[14:]) == {(b, 1) for b in range(4, 10)}   # after the first token: what layer 1 wrote
    assert sum(e[0] == "offer" for e in rec.heard) == 1 and rec.heard[-1] == ("commit", [42])
    tx_bytes = 10 * KVBlockIO([(torch.randn(12, 4, 2, 8), torch.randn(12, 4, 2, 8))] * 2).bytes_per_block
    assert done.ok and done.num_blocks == 10 and done.num_blocks_ahead == 4 and done.num_bytes == tx_bytes
    assert done.num_bytes_ahead == 4 * tx_bytes // 10 + 6 * tx_bytes // 20   # blocks 0-3 whole, 4-9's layer 0
    await system.shutdown()


async def test_a_cancelled_handoff_sent_ahead_lets_the_receiver_go_and_reports_nothing():
    system = ActorSystem("ahead-cancel-test")
    rec = RecordingReceiver()
    tx, receiver, offer, dones = await _ahead_pair(system, rec)
    tx.tell(HandoffSendAhead(3, [5, 6, 7], 3, offer, receiver))
    await _heard(rec, lambda: rec.blocks() == [0, 1, 2])
    tx.tell(HandoffWithdraw(3))
    await _heard(rec, lambda: rec.heard[-1] == ("cancel",))
    await asyncio.sleep(0.1)
    assert not dones   # the scheduler freed the blocks itself: no HandoffSent for them
    await system.shutdown()


async def test_a_refused_offer_ahead_is_made_again_whole_after_the_first_token():
    system = ActorSystem("ahead-refused-test")
    rec = RecordingReceiver(refuse=1)
    tx, receiver, offer, dones = await _ahead_pair(system, rec)
    table = list(range(10))
    tx.tell(HandoffSendAhead(1, table[:4], 4, offer, receiver))
    await _heard(rec, lambda: rec.heard)
    await asyncio.sleep(0.05)
    tx.tell(HandoffSendAhead(1, table[:8], 8, offer, receiver))   # nothing more goes on that handoff
    await asyncio.sleep(0.05)
    assert rec.heard == [("offer", [])]
    tx.tell(HandoffSend(1, table, msgspec.structs.replace(offer, transfer_id="again", output_token_ids=[9]), receiver))
    await _first_done(dones)
    assert rec.heard[1] == ("offer", [9]) and rec.heard[-1] == ("commit", None)
    assert rec.blocks() == list(range(10))
    assert dones[0].ok and dones[0].num_blocks == 10 and dones[0].num_blocks_ahead == 0
    await system.shutdown()


class MuteReceiver(Actor):
    """Accepts an offer, then answers a chunk only after the sender's timeout: a decode engine that hangs."""

    def __init__(self):
        self.cancelled: list[str] = []

    async def receive(self, msg):
        match msg:
            case HandoffOffer():
                return HandoffOfferReply(True)
            case HandoffChunk():
                await asyncio.sleep(0.5)
                return msg.num_blocks
            case HandoffCancel(transfer_id=tid):
                self.cancelled.append(tid)


async def test_a_sender_that_gives_up_tells_the_receiver_to_let_its_blocks_go():
    system = ActorSystem("cancel-test")
    receiver_actor = MuteReceiver()
    _, _, result = await _hand_over_ten_blocks(system, receiver_actor, lambda b: KVTransferConfig(timeout_s=0.2), "t2")
    assert not result.ok and not result.refused
    for _ in range(150):
        if receiver_actor.cancelled:
            break
        await asyncio.sleep(0.02)
    assert receiver_actor.cancelled == ["t2"]
    await system.shutdown()


async def test_a_cancelled_handoff_gives_the_decode_engine_its_blocks_back(pair):
    system, prefill, decode, dec_tx, front, front_ref = pair
    io = decode.kv_blocks
    prompt = [random.Random(3).randrange(4, 300) for _ in range(50)]   # 4 blocks
    free = (await decode.kv.ask(GetKVStats())).num_free_blocks
    assert (await dec_tx.ask(HandoffOffer("gone", dec_tx, "gone", prompt, [7], GREEDY, front_ref, 0, None, 0,
                                     io.layout))).accepted
    assert (await decode.kv.ask(GetKVStats())).num_free_blocks == free - 4
    dec_tx.tell(HandoffCancel("gone"))
    for _ in range(100):
        if (await decode.kv.ask(GetKVStats())).num_free_blocks == free:
            break
        await asyncio.sleep(0.02)
    assert (await decode.kv.ask(GetKVStats())).num_free_blocks == free
    stats = await decode.scheduler.ask(GetStats())
    assert stats.requests_running + stats.requests_waiting == 0 and stats.kv_handoffs_received == 0


@pytest.mark.parametrize("offered, committed, problem, last_layer", [
    ([], None, "without exactly one", 0), ([], [5, 6], "without exactly one", 0),
    ([7], [5], "tokens its offer already had", 0), ([], [5], "with 0 of 2 blocks written", -1)])
async def test_a_commit_that_does_not_match_its_offers_tokens_or_blocks_is_refused(pair, offered, committed, problem,
                                                                                  last_layer):
    """Offered ahead, the blocks hold the prompt alone: the commit brings exactly the first token;
    offered whole, it brings none; and every layer of every block must be in (`last_layer` -1: the
    chunk lacks the last one)."""
    system, prefill, decode, dec_tx, front, front_ref = pair
    io = decode.kv_blocks
    prompt = [random.Random(9).randrange(4, 300) for _ in range(32)]   # 2 full blocks
    free = (await decode.kv.ask(GetKVStats())).num_free_blocks
    assert (await dec_tx.ask(HandoffOffer("odd", dec_tx, "odd", prompt, offered, GREEDY, front_ref, 0, None, 0,
                                     io.layout))).accepted
    layers = range(io.num_layers + last_layer)
    assert await dec_tx.ask(HandoffChunk("odd", 0, 2, bytes(io.nbytes(2, layers)), 0, len(layers))) == 2
    with pytest.raises(Exception, match=problem):
        await dec_tx.ask(HandoffCommit("odd", committed))
    for _ in range(100):
        if (await decode.kv.ask(GetKVStats())).num_free_blocks == free:
            break
        await asyncio.sleep(0.02)
    assert (await decode.kv.ask(GetKVStats())).num_free_blocks == free
    assert not front.handed_over and (await decode.scheduler.ask(GetStats())).kv_handoffs_received == 0


async def test_a_handoff_whose_sender_goes_quiet_gives_its_blocks_back(pair):
    """A sender that hangs without dying (no chunk, no commit, no cancel, its node still up)."""
    system, prefill, decode, dec_tx, front, front_ref = pair
    io = decode.kv_blocks
    quick = await system.spawn(KVTransfer(io, decode.scheduler, decode.config.block_size,
                                          KVTransferConfig(timeout_s=0.1)), name="dec-quick")
    prompt = [random.Random(5).randrange(4, 300) for _ in range(50)]   # 4 blocks
    free = (await decode.kv.ask(GetKVStats())).num_free_blocks
    assert (await quick.ask(HandoffOffer("hung", quick, "hung", prompt, [7], GREEDY, front_ref, 0, None, 0,
                                    io.layout))).accepted
    assert (await decode.kv.ask(GetKVStats())).num_free_blocks == free - 4
    for _ in range(100):
        if (await decode.kv.ask(GetKVStats())).num_free_blocks == free:
            break
        await asyncio.sleep(0.02)
    assert (await decode.kv.ask(GetKVStats())).num_free_blocks == free   # back after 2 x 0.1 s of quiet
    with pytest.raises(Exception, match="no handoff hung"):   # a late chunk fails its handoff
        await quick.ask(HandoffChunk("hung", 0, 1, io.read([0])))
    await system.stop(quick)


@pytest.mark.parametrize("host", [None, False], ids=["numpy", "torch"])   # a CPU cache's path, an accelerator's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_come_back_byte_for_byte_and_a_wrong_size_is_refused(host, dtype):
    src = [(torch.randn(6, 4, 2, 8).to(dtype), torch.randn(6, 4, 2, 8).to(dtype)) for _ in range(3)]
    dst = [(torch.zeros(9, 4, 2, 8, dtype=dtype), torch.zeros(9, 4, 2, 8, dtype=dtype)) for _ in range(3)]
    a, b = KVBlockIO(src, host), KVBlockIO(dst, host)
    assert (a._rows is not None) == (host is None)
    name = str(dtype).removeprefix("torch.")
    assert a.layout == b.layout == f"3x({name}[4x2x8],{name}[4x2x8])"
    data = a.read([4, 1])
    assert len(data) == 2 * a.bytes_per_block
    assert bytes(KVBlockIO(src, False if host is None else None).read([4, 1])) == bytes(data)   # one layout
    b.write([0, 7], bytes(data))
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[0], sk[4]) and torch.equal(dk[7], sk[1]) and torch.equal(dv[7], sv[1])
        assert not dk[1].any()
    b.write([3, 4, 5, 8], bytes(a.read([0, 1, 2, 5])))   # runs of neighbours on either side
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[3:6], sk[0:3]) and torch.equal(dv[8], sv[5])
    with pytest.raises(ValueError, match="expected"):
        b.write([0], bytes(data))


@pytest.mark.parametrize("host", [None, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_a_quantized_cache_moves_with_its_scales_and_refuses_another_layout(host, code):
    def cache(num_blocks, fill):
        make = (lambda *shape: torch.randint(-127, 128, shape, dtype=torch.int8).to(code)) if fill else \
            (lambda *shape: torch.zeros(shape, dtype=code))
        scales = (lambda: torch.rand(num_blocks, 2)) if fill else (lambda: torch.zeros(num_blocks, 2))
        return [LayerKV(make(num_blocks, 4, 2, 8), make(num_blocks, 4, 2, 8), scales(), scales()) for _ in range(2)]
    src, dst = cache(6, True), cache(9, False)
    a, b = KVBlockIO(src, host), KVBlockIO(dst, host)
    name = str(code).removeprefix("torch.")
    assert a.layout == b.layout == f"2x({name}[4x2x8],{name}[4x2x8],float32[2],float32[2])"
    assert a.bytes_per_block == 2 * (2 * 4 * 2 * 8 + 2 * 2 * 4)
    b.write([8, 0], bytes(a.read([2, 3])))
    raw = lambda t: t.view(torch.uint8)   # fp8 has no torch.equal on the CPU: compare the bytes
    for s, d in zip(src, dst):
        for st, dt in zip(s, d):
            assert torch.equal(raw(dt[8]), raw(st[2])) and torch.equal(raw(dt[0]), raw(st[3])) and not raw(dt[1]).any()
    plain = KVBlockIO([(torch.zeros(6, 4, 2, 8, dtype=torch.bfloat16),) * 2 for _ in range(2)])
    assert plain.layout != a.layout   # a handoff between the two is refused on the offer


def test_reserved_blocks_reuse_the_prefix_cache_and_are_hashed_only_once_confirmed():
    from actors.kv.kv_actor import apply_kv_reserve
    from actors.kv.manager import KVCacheManager
    from actors.kv.structs import KVCacheConfig, KVRequest
    from actors.messages.kv import KVReserve

    kv = KVCacheManager(KVCacheConfig(num_blocks=12, block_size=4))
    cached = list(range(10, 18))   # two full blocks, computed and cached by an earlier sequence
    hit = kv.get_computed_blocks(KVRequest("0", cached + [1]))
    kv.allocate_slots("0", 9, hit=hit)
    kv.free("0")
    tokens = cached + list(range(30, 37)) + [99]   # 15 positions with KV, then the first token
    reserved = apply_kv_reserve(kv, KVReserve(1, tokens, 15))
    assert reserved.num_hit_blocks == 2 and len(reserved.block_table) == 4
    probe = KVRequest("probe", tokens)
    assert kv.get_computed_blocks(probe).num_computed_tokens == 8   # the arriving blocks serve no hit yet
    kv.trim("1", 15)   # KVConfirm: the KV is written
    assert kv.get_computed_blocks(probe).num_computed_tokens == 12
    assert kv.num_computed_tokens("1") == 15
    assert apply_kv_reserve(kv, KVReserve(2, list(range(200, 240)), 39)).block_table is None   # no room
    kv.check_invariants()


@pytest.mark.parametrize("host", [None, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_blocks_go_layer_by_layer_and_make_up_the_whole(host, quantized):
    def cache(num_blocks, fill):
        make = (lambda *shape: torch.randint(-127, 128, shape, dtype=torch.int8)) if quantized else torch.randn
        if not fill:
            make = (lambda *shape: torch.zeros(shape, dtype=torch.int8 if quantized else torch.float32))
        scales = (lambda: torch.rand(num_blocks, 2) if fill else torch.zeros(num_blocks, 2))
        return [LayerKV(make(num_blocks, 4, 2, 8), make(num_blocks, 4, 2, 8), *((scales(), scales()) if quantized
                                                                                else (None, None)))
                for _ in range(3)]
    src, dst = cache(6, True), cache(9, False)
    a, b = KVBlockIO(src, host), KVBlockIO(dst, host)
    first = a.read([4, 1], range(0, 1))
    assert len(first) == a.nbytes(2, range(0, 1)) == 2 * a.bytes_per_block // 3
    b.write([0, 7], bytes(first), range(0, 1))
    assert not b.read([0, 7], range(1, 3)).tobytes().strip(b"\0")   # the other layers untouched
    b.write([0, 7], bytes(a.read([4, 1], range(1, 3))), range(1, 3))
    assert bytes(b.read([0, 7])) == bytes(a.read([4, 1]))   # the layers make up the whole blocks
    with pytest.raises(ValueError, match="outside"):
        a.read([0], range(2, 4))
    with pytest.raises(ValueError, match="expected"):
        b.write([0], bytes(first), range(0, 1))   # two blocks' bytes for one
