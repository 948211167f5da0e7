"""--batch-invariant: a sequence's numbers do not depend on the rest of its step, on how its prompt was
chunked, or on what the prefix cache held.

Eight prompts of 5 to 200 tokens, each run alone, all together, all again (their prompts now in the prefix
cache), and in an engine that computes at most 48 tokens a step (each prompt chunked differently, beside
other prompts' chunks and decodes): the tokens, and the logprob of every token and of its top alternatives,
identical bit for bit. On a random Llama in float32 and bf16, and on the default model (SmolLM2's GGUF,
bf16 activations); a seeded sampled request likewise.
"""
from __future__ import annotations

import random

import pytest
import torch

from actors import LLM, SamplingParams
from actors.config import EngineConfig
from kernels import cpu_native
from tests.actors.conftest import TINY_VOCAB

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the batch-invariant kernels are the CPU C ones")

LENGTHS = (5, 17, 33, 40, 64, 90, 129, 200)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True, logprobs=3)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in LENGTHS]


def numbers(results) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each sequence's tokens and logprobs (floats compared exactly)."""
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]


def four_ways(model: str, dtype: str, params: SamplingParams, vocab: int, **config):
    batch = prompts(vocab)
    common = dict(dtype=dtype, num_threads=2, batch_invariant=True, **config)
    with LLM(model, **common) as llm:
        alone = numbers([llm.generate([p], params)[0] for p in batch])
        together = numbers(llm.generate(batch, params))
        cached = llm.generate(batch, params)
        assert all(r.num_cached_tokens > 0 for r, n in zip(cached, LENGTHS) if n > 16)   # the cache did serve
    with LLM(model, max_num_batched_tokens=48, **common) as llm:
        chunked = numbers(llm.generate(batch, params))
    return alone, together, numbers(cached), chunked


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_random_models_sequences_are_the_same_alone_together_cached_and_chunked(tiny_model_dir, dtype, params):
    alone, together, cached, chunked = four_ways(tiny_model_dir("llama"), dtype, params, TINY_VOCAB, num_blocks=128)
    assert together == alone
    assert cached == alone
    assert chunked == alone


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_default_models_sequences_are_the_same_alone_together_cached_and_chunked(params):
    alone, together, cached, chunked = four_ways(None, "bfloat16", params, 49152, num_blocks=256)
    assert together == alone and cached == alone and chunked == alone


@pytest.mark.parametrize("config,message", [
    (dict(quantization="int4"), "int4 matmul"),
    (dict(enable_lora=True), "LoRA adapters"),
    (dict(kernels="torch"), "CPU C kernels"),
])
def test_what_it_cannot_promise_is_refused(tiny_model_dir, config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=tiny_model_dir("llama"), batch_invariant=True, **config)


def test_the_kernels_never_switch_by_the_rows(tiny_model_dir):
    """No projection weight keeps a row count from which another kernel takes over, and attention sends every
    query run to the decode kernel."""
    from kernels import get_ops
    from kernels.packed_linear import PackedWeight

    ops = get_ops("cpu", "cpu", batch_invariant=True)
    packed = ops.prepare_weight(torch.randn(64, 128).to(torch.bfloat16))
    assert isinstance(packed, PackedWeight) and packed.plain is None and packed.amx_from is None
    assert ops.batch_invariant and ops.paged_attention.__name__ == "invariant_paged_attention"
