"""Drafting on a separate draft node: an engine attaches over TCP (the runtime's transport, found
through the registry), gets its own draft worker there, and the outputs stay exactly the target's.
A node that goes away costs only the drafts; a node that refuses (another vocabulary, no model)
stops the engine's start with its reason."""
from __future__ import annotations

import asyncio

import pytest

from actors.config import EngineConfig
from actors.draft.config import SpeculativeConfig
from actors.draft.draft_link import DRAFT_NODE_PREFIX
from actors.draft.draft_service import DraftService
from actors.draft.messages import AttachDraft, DraftAttached, GetDraftStats
from actors.engine import start_engine
from actors.messages.front_end import GetStats, SubmitRequest
from runtime import ActorSystem
from runtime.registry import InMemoryRegistry
from tests.actors.test_engine import Sink
from tests.actors.test_llm_parity import GREEDY, hf_greedy, prompts
from tests.actors.test_spec_engine import repetitive

SECRET = b"draft-node-test-secret"


async def draft_node(registry, spec: dict, node_id: str = "d1") -> ActorSystem:
    system = ActorSystem(f"draft-{node_id}", listen=("127.0.0.1", 0), secret=SECRET, registry=registry)
    await system.start()
    ref = await system.spawn(DraftService(SpeculativeConfig.parse(spec), num_threads=1), name="draft-service")
    await system.publish(DRAFT_NODE_PREFIX + node_id, ref)
    return system


def engine_config(folder: str, **spec) -> EngineConfig:
    return EngineConfig(model=folder, dtype="float32", num_threads=1, num_blocks=96, max_num_batched_tokens=64,
                        speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False,
                                     "disable_batch_size": None, "draft_node": "d1", **spec})


async def generate(system: ActorSystem, eng, batch: list[list[int]], tag: str) -> list[list[int]]:
    sink = Sink()
    ref = await system.spawn(sink, name=f"sink-{tag}")
    for i, p in enumerate(batch):
        eng.scheduler.tell(SubmitRequest(f"{tag}{i}", p, GREEDY, ref))
    await sink.wait(lambda: all((f"{tag}{i}", 0) in sink.finish for i in range(len(batch))), timeout=120)
    return [sink.tokens[(f"{tag}{i}", 0)] for i in range(len(batch))]


def local_draft_tokens(folder: str, batch: list[list[int]]) -> int:
    """Drafted tokens for `batch` with the same proposer in the engine's own process."""
    from actors import LLM

    cfg = engine_config(folder)
    spec = {k: v for k, v in cfg.speculative.__dict__.items() if k != "draft_node"}
    with LLM(folder, dtype="float32", num_threads=1, num_blocks=96, max_num_batched_tokens=64,
             speculative=spec) as llm:
        llm.generate(batch, GREEDY)
        return llm.stats().spec_decode_draft_tokens


async def drafted(eng) -> int:
    return (await eng.scheduler.ask(GetStats())).spec_decode_draft_tokens


async def test_engine_drafts_on_a_draft_node_and_outlives_it(tiny_model_dir):
    folder = tiny_model_dir("llama")
    batch = [repetitive(40, 7, 1), repetitive(90, 13, 2)] + prompts(0, (5, 33))
    want = local_draft_tokens(folder, batch)
    assert want > 0
    registry = InMemoryRegistry()
    node = await draft_node(registry, {"method": "ngram", "num_speculative_tokens": 3})
    system = ActorSystem("engine-e1", listen=("127.0.0.1", 0), secret=SECRET, registry=registry)
    await system.start()
    eng = await start_engine(engine_config(folder), system)
    try:
        assert await generate(system, eng, batch, "a") == hf_greedy(folder, batch)
        assert await drafted(eng) == want          # the node kept every sequence's state in step
        remote = await eng.draft.ask(GetDraftStats())
        assert remote.steps > 0 and remote.num_seqs == 0    # ran on the node; every sequence released

        await node.shutdown()                                # the draft node goes away mid-service
        batch2 = [repetitive(50, 9, 3)] + prompts(1, (20,))
        assert await generate(system, eng, batch2, "b") == hf_greedy(folder, batch2)
        stats = await eng.scheduler.ask(GetStats())
        assert stats.kv_blocks_free == stats.kv_blocks_total

        # A node of that id comes back: after the link's back-off it attaches again in the background.
        node = await draft_node(registry, {"method": "ngram", "num_speculative_tokens": 3})
        await asyncio.sleep(5.5)
        await generate(system, eng, [prompts(2, (4,))[0]], "c")   # a step that starts the attach
        for _ in range(100):
            if (await eng.draft.ask(GetDraftStats())).steps > 0:
                break
            await asyncio.sleep(0.05)
        before = await drafted(eng)
        assert await generate(system, eng, batch, "d") == hf_greedy(folder, batch)
        assert await drafted(eng) - before == want
    finally:
        await eng.stop()
        await system.shutdown()
        await node.shutdown()


async def test_a_refusing_draft_node_stops_the_engine_start_with_its_reason(tiny_model_dir):
    registry = InMemoryRegistry()
    node = await draft_node(registry, {"method": "draft", "model": "/nonexistent/draft-model"})
    system = ActorSystem("engine-e2", listen=("127.0.0.1", 0), secret=SECRET, registry=registry)
    await system.start()
    try:
        with pytest.raises(ValueError, match="draft node 'd1'.*nonexistent"):
            await start_engine(engine_config(tiny_model_dir("llama"), method="draft"), system)
    finally:
        await system.shutdown()
        await node.shutdown()


async def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dir):
    folder = tiny_model_dir("llama")
    system = ActorSystem("draft-vocab")
    await system.start()
    try:
        service = await system.spawn(DraftService(SpeculativeConfig.parse({"method": "draft", "model": folder}),
                                                  num_threads=1))
        wrong = AttachDraft("e", 16, 32, vocab_size=1000, vocab_digest="0" * 64)
        reply: DraftAttached = await service.ask(wrong, timeout=60)
        assert reply.worker is None and "vocabulary" in reply.error
    finally:
        await system.shutdown()


def test_layerskip_cannot_run_on_a_draft_node():
    with pytest.raises(ValueError, match="layerskip"):
        SpeculativeConfig.parse({"method": "layerskip", "draft_layers": 1, "draft_node": "d1"})
    with pytest.raises(ValueError, match="runs inside the engine"):
        DraftService(SpeculativeConfig.parse({"method": "layerskip", "draft_layers": 1}))
    assert SpeculativeConfig.parse({"method": "draft", "draft_node": "d1"}).model is None  # the node has it
