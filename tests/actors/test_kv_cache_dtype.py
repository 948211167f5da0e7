"""--kv-cache-dtype int8 | fp8: the pool's size and bytes, and greedy parity of the engine with the C
kernels against the torch reference over the same quantized cache (kernels/kv_quant.py), through
chunked prefill, shared prefixes, preemption and speculative decoding."""
from __future__ import annotations

import pytest
import torch

from actors import LLM
from actors.config import EngineConfig
from actors.model.value_bytes import kv_bytes_per_block
from actors.worker.model_runner import ModelRunner
from kernels import cpu_native
from tests.actors.test_llm_parity import assert_pool_back, engine_greedy, prompts
from tests.actors.test_spec_engine import repetitive, spec_config

CACHE_DTYPES = ["int8", "fp8"]


def _held_bytes(runner: ModelRunner) -> int:
    return sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer if t is not None)


@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
def test_the_pool_holds_twice_the_tokens_of_bfloat16(smollm2_gguf, kv_cache_dtype):
    """SmolLM2 (30 layers, 3 KV heads of 64) in the default 1 GiB: one byte a value and a float32 scale per
    (block of 16, KV head) for K and V, 64.25 bytes a head where bfloat16 takes 128: 1.992x its tokens
    (3.98x float32's), the scales counted in the budget."""
    budget = 1 << 30   # allocated lazily: the untouched pages cost nothing
    runners = {name: ModelRunner(smollm2_gguf, dtype=dtype, kernels="torch", kv_cache_memory=budget, num_threads=1,
                                 kv_cache_dtype=kv)
               for name, dtype, kv in (("bf16", "bfloat16", "auto"), ("f32", "float32", "auto"),
                                       ("quant", "bfloat16", kv_cache_dtype))}
    quant = runners["quant"]
    per_block = 30 * 3 * 2 * (16 * 64 + 4)
    assert quant.kv_bytes_per_block == per_block == kv_bytes_per_block(30, 3, 64, 1, 16, scaled=True)
    assert quant.kv_bytes_per_token == per_block / 16
    assert quant.num_blocks == budget // per_block
    assert _held_bytes(quant) == quant.num_blocks * per_block <= budget
    assert quant.num_blocks >= 1.99 * runners["bf16"].num_blocks
    assert quant.num_blocks >= 3.98 * runners["f32"].num_blocks
    assert _held_bytes(runners["bf16"]) == runners["bf16"].num_blocks * 16 * 30 * 3 * 64 * 2 * 2
    layer = quant.kv_caches[0]
    assert layer.k.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    assert layer.k_scales.shape == (quant.num_blocks, 3) and layer.k_scales.dtype == torch.float32


def test_bad_values_are_refused_with_a_clear_error(tiny_model_dir):
    folder = tiny_model_dir("llama")
    for bad in ("int4", "float8", "", "INT8"):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            EngineConfig(model=folder, kv_cache_dtype=bad)
        with pytest.raises(ValueError, match="unsupported kv_cache_dtype"):
            ModelRunner(folder, kernels="torch", num_blocks=4, num_threads=1, kv_cache_dtype=bad)


def test_the_flag_reaches_the_engine(tiny_model_dir):
    import argparse

    from gateway import flags

    parser = argparse.ArgumentParser()
    flags.add_flags(parser, EngineConfig, environ={})
    assert flags.build(EngineConfig, parser.parse_args(["--model", tiny_model_dir("llama"),
                                                         "--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])


def _llm(folder: str, kernels: str, kv_cache_dtype: str, **kw) -> LLM:
    return LLM(folder, dtype="float32", kernels=kernels, num_threads=1, block_size=16,
               kv_cache_dtype=kv_cache_dtype, **kw)


@pytest.mark.skipif(not cpu_native.available(), reason="no AVX2 CPU or no C compiler")
@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_parity_with_the_reference_over_the_same_quantized_cache(arch, kv_cache_dtype, tiny_model_dir):
    """The C kernels write the same codes and scales as the reference and attend over them to float32
    rounding: greedy tokens agree, through chunked prefill (48-token budget), a pool small enough to
    preempt, and a shared prefix served from the cache. The stats report the pool."""
    folder = tiny_model_dir(arch)
    batch = prompts(1)
    shared = [prompts(4, (40,))[0] + p for p in prompts(5, (3, 17))]
    outputs = {}
    for kernels in ("torch", "cpu"):
        with _llm(folder, kernels, kv_cache_dtype, num_blocks=24, max_num_batched_tokens=48) as llm:
            outputs[kernels] = (engine_greedy(llm, batch) + engine_greedy(llm, shared[:1])
                                + engine_greedy(llm, shared[1:]))
            s = llm.stats()
            assert s.preemptions > 0 and s.prefix_cache_hit_tokens >= 32
            assert s.kv_token_capacity == 24 * 16
            kv_heads = {"llama": 2, "qwen2": 1}[arch]   # 3 layers, head dim 16: 16 x 16 codes + a scale a block
            assert s.kv_bytes_per_token == kv_bytes_per_block(3, kv_heads, 16, 1, 16, scaled=True) / 16
            assert_pool_back(llm)
    assert outputs["cpu"] == outputs["torch"]


@pytest.mark.skipif(not cpu_native.available(), reason="no AVX2 CPU or no C compiler")
@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("method", ["layerskip", "ngram"])
def test_speculative_decoding_over_a_quantized_cache(method, kv_cache_dtype, tiny_model_dir):
    """Drafts verified over a quantized cache (a layer-skip draft writes into it too), with rejections
    and a pool small enough to preempt: the C kernels give the reference's greedy tokens, and every
    block comes back. (Not plain decoding's tokens, bit for bit: a rejected draft's K/V may have grown
    its block's scale, requantizing the block's earlier tokens; kernels/kv_quant.py.)"""
    folder = tiny_model_dir("llama")
    batch = prompts(0)[:6] + [repetitive(40, 7, 1), repetitive(90, 13, 2)]
    outputs = {}
    for kernels in ("torch", "cpu"):
        with _llm(folder, kernels, kv_cache_dtype, num_blocks=24, max_num_batched_tokens=64,
                  speculative=spec_config(method)) as llm:
            outputs[kernels] = engine_greedy(llm, batch)
            s = llm.stats()
            assert s.spec_decode_accepted_tokens < s.spec_decode_draft_tokens   # rejections
            if method == "layerskip":   # (random weights: n-grams rarely hold, and make short runs)
                assert s.spec_decode_accepted_tokens > 0 and s.preemptions > 0
            assert_pool_back(llm)
    assert outputs["cpu"] == outputs["torch"]
