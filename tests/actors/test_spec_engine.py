"""Speculative decoding through the whole engine (scheduler, KV manager, draft and target workers).

Greedy outputs with each method equal transformers' greedy tokens (which plain decoding matches,
see test_llm_parity), for prompts of 1 to 300 tokens decoded together under a small token budget
(chunked prefill beside verification), with requests too short to speculate in the same batch.
After rejections, aborts and preemptions every block is back in the pool and the draft worker
holds no sequence state.
"""
from __future__ import annotations

import asyncio

import pytest

from actors import LLM, SamplingParams
from actors.draft.messages import GetDraftStats
from actors.messages.front_end import AbortRequest, GetStats, SubmitRequest
from tests.actors.conftest import TINY_VOCAB, build_tiny_model
from tests.actors.test_engine import Sink
from tests.actors.test_llm_parity import GREEDY, NUM_NEW, assert_pool_back, hf_greedy, prompts
from runtime import ActorSystem


@pytest.fixture(scope="session")
def draft_model_dir(tmp_path_factory):
    """Another tiny Llama with the same tokenizer and different weights: a draft that often disagrees."""
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("tiny-draft")), seed=1)


@pytest.fixture(scope="session")
def close_draft_dir(tiny_model_dir, tmp_path_factory):
    """The target with noise on its last layer's MLP: a draft that mostly agrees, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama")
    dst = str(tmp_path_factory.mktemp("tiny-close-draft"))
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(f"{src}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.startswith("model.layers.2.mlp"):
            weights[name] = w + 0.2 * w.std() * torch.randn(w.shape, generator=g)
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return dst


def spec_config(method: str, draft_dir: str | None = None) -> dict:
    cfg = {"method": method, "num_speculative_tokens": 3, "adaptive": False, "disable_batch_size": None}
    if method == "layerskip":
        cfg["draft_layers"] = 1
    if method == "draft":
        cfg["model"] = draft_dir
    return cfg


def repetitive(n: int, period: int, seed: int) -> list[int]:
    base = prompts(seed, (period,))[0]
    return (base * (n // period + 1))[:n]


@pytest.mark.parametrize("method", ["ngram", "layerskip", "draft", "draft-close"])
def test_greedy_outputs_equal_plain_decoding(method, tiny_model_dir, draft_model_dir, close_draft_dir):
    folder = tiny_model_dir("llama")
    batch = prompts(0) + [repetitive(40, 7, 1), repetitive(90, 13, 2)]
    short = prompts(5, (9, 33))
    with LLM(folder, dtype="float32", num_threads=1, num_blocks=160, max_num_batched_tokens=64,
             speculative=spec_config(method.split("-")[0], close_draft_dir if "close" in method
                                     else draft_model_dir)) as llm:
        params = [GREEDY] * len(batch) + [SamplingParams(temperature=0.0, max_tokens=1),
                                          SamplingParams(temperature=0.0, max_tokens=2)]
        outs = llm.generate(batch + short, params)
        assert [o.outputs[0].token_ids for o in outs[:len(batch)]] == hf_greedy(folder, batch)
        ref_short = hf_greedy(folder, short)
        assert [o.outputs[0].token_ids for o in outs[len(batch):]] == [ref_short[0][:1], ref_short[1][:2]]
        stats = llm.stats()
        print(method, stats)
        assert stats.spec_decode_draft_tokens > 0
        assert stats.spec_decode_num_drafts > 0
        assert stats.generation_tokens == NUM_NEW * len(batch) + 3
        assert stats.spec_decode_mean_accepted_length >= 1.0
        assert_pool_back(llm)


async def test_blocks_return_after_rejections_aborts_and_preemptions(tiny_model_dir, close_draft_dir):
    from actors.config import EngineConfig
    from actors.engine import start_engine

    folder = tiny_model_dir("llama")
    system = ActorSystem("spec-blocks")
    await system.start()
    cfg = EngineConfig(model=folder, dtype="float32", num_threads=1, block_size=16, num_blocks=24,
                       max_num_batched_tokens=64, speculative=spec_config("draft", close_draft_dir))
    eng = await start_engine(cfg, system)
    try:
        sink = Sink()
        ref = await system.spawn(sink, name="sink")
        batch = prompts(3, (40, 55, 70, 85, 100, 62))
        sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, ignore_eos=True, seed=4)
        for i, p in enumerate(batch):
            eng.scheduler.tell(SubmitRequest(f"g{i}", p, GREEDY, ref))
        for i, p in enumerate(batch[:3]):
            eng.scheduler.tell(SubmitRequest(f"s{i}", p, sampled, ref))
        await sink.wait(lambda: len(sink.tokens.get(("s0", 0), [])) >= 3)
        eng.scheduler.tell(AbortRequest("s0"))
        eng.scheduler.tell(AbortRequest("s2"))
        ids = [f"g{i}" for i in range(len(batch))] + ["s0", "s1", "s2"]
        await sink.wait(lambda: all((r, 0) in sink.finish for r in ids), timeout=120)
        assert [sink.tokens[(f"g{i}", 0)] for i in range(len(batch))] == hf_greedy(folder, batch)
        assert sink.finish[("s0", 0)] == "abort" and sink.finish[("s1", 0)] == "length"
        stats = await eng.scheduler.ask(GetStats())
        assert stats.preemptions > 0
        assert 0 < stats.spec_decode_accepted_tokens < stats.spec_decode_draft_tokens  # rejections happened
        assert stats.kv_blocks_free == stats.kv_blocks_total == 24
        draft = await eng.draft.ask(GetDraftStats())
        assert draft.num_seqs == 0 and draft.steps > 0
    finally:
        await eng.stop()
        await system.shutdown()


def test_seeded_sampling_repeats_across_batch_mixes(tiny_model_dir, close_draft_dir):
    with LLM(tiny_model_dir("llama"), dtype="float32", num_threads=1, num_blocks=64, max_num_batched_tokens=64,
             speculative=spec_config("draft", close_draft_dir)) as llm:
        p = prompts(7, (20,))[0]
        sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=11, ignore_eos=True)
        alone = llm.generate([p], sp)[0].outputs[0].token_ids
        others = prompts(8, (50, 3, 90))
        mixed = llm.generate([others[0], p] + others[1:], [GREEDY, sp, GREEDY, GREEDY])[1].outputs[0].token_ids
        assert alone == mixed and len(alone) == 20
        again = llm.generate([p], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=12,
                                                 ignore_eos=True))[0].outputs[0].token_ids
        assert again != alone
        stats = llm.stats()
        assert stats.spec_decode_draft_tokens > 0
        assert_pool_back(llm)


def test_logprobs_penalties_and_n_with_drafts(tiny_model_dir, close_draft_dir):
    folder = tiny_model_dir("llama")
    batch = prompts(9, (12, 40, 70))
    greedy_lp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    penalized = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.5, presence_penalty=0.3)
    n2 = SamplingParams(temperature=0.8, top_k=20, max_tokens=10, ignore_eos=True, n=2, seed=3)
    params = [greedy_lp, penalized, n2]
    common = dict(dtype="float32", num_threads=1, num_blocks=64, max_num_batched_tokens=64)
    with LLM(folder, **common) as llm:
        plain = llm.generate(batch, params)
    with LLM(folder, **common, speculative=spec_config("draft", close_draft_dir)) as llm:
        spec = llm.generate(batch, params)
        assert llm.stats().spec_decode_accepted_tokens > 0
        assert_pool_back(llm)
    for a, b in zip(plain[:2], spec[:2]):  # greedy, with logprobs or penalties: the same tokens
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for lp_a, lp_b in zip(plain[0].outputs[0].logprobs, spec[0].outputs[0].logprobs):
        assert lp_a.keys() == lp_b.keys() and len(lp_a) >= 2
        assert all(abs(lp_a[t] - lp_b[t]) < 1e-4 for t in lp_a)
    assert [len(o.token_ids) for o in spec[2].outputs] == [10, 10]


def test_engine_learns_what_drafting_costs(tiny_model_dir):
    """The scheduler feeds each pure-decode step's wall time to the controller's cost model."""
    from actors.messages.step import ScheduledSeq, StepPlan
    from actors.scheduler.scheduler_actor import _decode_shape

    decode = ScheduledSeq(1, [5], 40, [0, 1, 2], True, [6, 7])
    assert _decode_shape(StepPlan(1, [decode, ScheduledSeq(2, [9], 12, [3], True)])) == (2, 2)
    assert _decode_shape(StepPlan(2, [decode, ScheduledSeq(3, [1, 2, 3], 0, [4], True)])) is None  # prefill

    cfg = {"method": "ngram", "num_speculative_tokens": 4, "disable_batch_size": None, "verify_cost": 0.05}
    with LLM(tiny_model_dir("llama"), dtype="float32", num_threads=1, num_blocks=64,
             speculative=cfg) as llm:
        assert llm.stats().spec_decode_token_cost == 0.05          # the prior, before any step
        llm.generate([repetitive(40, 7, 3), repetitive(30, 5, 4)],
                     SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        model = llm.engine.scheduler_actor.spec.cost
        assert len(model._steps) >= 8
        assert {x for _, x, _ in model._steps} != {0}
        assert model.measured
        assert llm.stats().spec_decode_token_cost == model.relative(1)
