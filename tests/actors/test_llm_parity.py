"""Greedy parity with transformers through the whole engine (LLM: scheduler, KV manager, worker).

Tiny random-weight Llama (GQA 2, untied, llama3 rope scaling), Llama tied (GQA 4), Qwen2 (QKV
bias, GQA 4) and Qwen3 (q/k norm) in float32; 8 prompts of 1 to 300 tokens run together, under a
token budget that forces chunked prefill, with shared prefixes hitting the cache, and with a block
pool small enough to force preemption. Every block is free (or cached and evictable) at the end.
"""
from __future__ import annotations

import random

import pytest
import torch

from actors import LLM, SamplingParams
from tests.actors.conftest import TINY_ARCHS, TINY_VOCAB

NUM_NEW = 12
PROMPT_LENS = (1, 5, 16, 31, 64, 129, 211, 300)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)

_hf_cache: dict[tuple[str, tuple], list[int]] = {}


def prompts(seed: int = 0, lens=PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in lens]


def hf_greedy(folder: str, batch: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    todo = [p for p in batch if (folder, tuple(p)) not in _hf_cache]
    if todo:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matrices: more threads only contend on a busy machine
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.generation_config.eos_token_id = None  # random weights: never stop early
        model.generation_config.pad_token_id = 1
        with torch.no_grad():
            for p in todo:
                ids = torch.tensor([p])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NUM_NEW, min_new_tokens=0)
                _hf_cache[(folder, tuple(p))] = out[0, len(p):].tolist()
        torch.set_num_threads(threads)
    return [_hf_cache[(folder, tuple(p))] for p in batch]


def engine_greedy(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(batch, GREEDY)
    assert [o.prompt_token_ids for o in outs] == batch
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def assert_pool_back(llm: LLM) -> None:
    s = llm.stats()
    assert s.requests_running == 0 and s.requests_waiting == 0
    assert s.kv_blocks_free == s.kv_blocks_total


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chunked_prefill_parity(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    batch = prompts()
    with LLM(folder, dtype="float32", num_threads=1, block_size=16, num_blocks=128,
             max_num_batched_tokens=48) as llm:
        assert engine_greedy(llm, batch) == hf_greedy(folder, batch)
        s = llm.stats()
        # 757 prompt tokens at 48 a step: the prompts were cut into many chunks.
        assert s.steps >= sum(PROMPT_LENS) // 48 + NUM_NEW - 1
        assert s.preemptions == 0
        assert_pool_back(llm)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_shared_prefix_parity_hits_the_cache(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    rng = random.Random(7)
    system = [rng.randrange(4, TINY_VOCAB) for _ in range(100)]
    batch = [system + p for p in prompts(3, (1, 2, 9, 16, 20, 33, 47, 150))]
    with LLM(folder, dtype="float32", num_threads=1, block_size=16, num_blocks=128,
             max_num_batched_tokens=256) as llm:
        first = engine_greedy(llm, batch[:1])
        rest = engine_greedy(llm, batch[1:])
        assert first + rest == hf_greedy(folder, batch)
        s = llm.stats()
        assert s.prefix_cache_hit_tokens >= 7 * 96  # six full blocks of the shared 100 tokens, each
        assert_pool_back(llm)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_small_pool_preemption_parity(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    batch = prompts(1)
    # 24 blocks of 16 = 384 slots for 757 prompt tokens: sequences must give blocks back.
    with LLM(folder, dtype="float32", num_threads=1, block_size=16, num_blocks=24,
             max_num_batched_tokens=128, enable_prefix_caching=False) as llm:
        assert engine_greedy(llm, batch) == hf_greedy(folder, batch)
        assert llm.stats().preemptions > 0
        assert_pool_back(llm)
