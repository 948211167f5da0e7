"""The memory plan: the serving chapter's figure, the reverse question, and the engine's own pool."""
from __future__ import annotations

import pytest

from actors.memory_plan import GB, GIB, MemoryPlan, blocks_that_fit, parse_size
from actors.model_shape import PRESETS, ModelShape
from actors.worker.model_runner import ModelRunner

CHAPTER = MemoryPlan(PRESETS["70b-gqa"], context_len=128 * 1024, concurrency=8, weight_dtype="bf16", kv_dtype="bf16")


def test_the_chapters_figure():
    # "weights 140 GB, KV 343.6 GB, total 484 GB ≈ 7 × H100", in 10^9-byte GB.
    assert CHAPTER.kv_bytes_per_token == 80 * 8 * 128 * 2 * 2
    assert CHAPTER.weight_bytes == 140 * GB
    assert round(CHAPTER.kv_bytes / GB, 1) == 343.6
    assert round(CHAPTER.total_bytes / GB) == 484
    assert CHAPTER.gpus_needed(80 * GB) == 7
    assert CHAPTER.kv_bytes / GIB == 320      # what 2^30 units would have printed instead


def test_the_reverse_concurrency_that_fits():
    assert CHAPTER.max_concurrency(7 * 80 * GB) >= 8
    assert CHAPTER.max_concurrency(6 * 80 * GB) < 8       # six GPUs were not enough for eight
    fit = CHAPTER.max_concurrency(7 * 80 * GB)
    assert MemoryPlan(CHAPTER.shape, CHAPTER.context_len, fit).total_bytes <= 7 * 80 * GB
    assert MemoryPlan(CHAPTER.shape, CHAPTER.context_len, fit + 1).total_bytes > 7 * 80 * GB
    assert CHAPTER.max_concurrency(100 * GB) == 0           # the weights alone do not fit


def test_precision_shrinks_both():
    q = MemoryPlan(CHAPTER.shape, CHAPTER.context_len, 8, weight_dtype="int4", kv_dtype="fp8")
    assert q.weight_bytes == 35 * GB                       # the chapter's "70B at 4 bits is ~35 GB"
    assert q.kv_bytes == CHAPTER.kv_bytes / 2
    with pytest.raises(ValueError, match="unknown precision 'int3'"):
        MemoryPlan(CHAPTER.shape, 1024, weight_dtype="int3")


def test_sizes_are_decimal_unless_binary():
    assert parse_size("80GB") == 80 * 10 ** 9 and parse_size("80GiB") == 80 << 30 and parse_size("512") == 512
    with pytest.raises(ValueError, match="not a size"):
        parse_size("eighty")


@pytest.mark.parametrize("budget", [1 << 20, 1_000_003])
def test_engine_pool_is_the_plans_arithmetic_tiny_model(tiny_model_dir, budget):
    folder = tiny_model_dir("llama_tied")
    plan = MemoryPlan(ModelShape.load(folder), context_len=16, kv_dtype="fp32")
    runner = ModelRunner(folder, dtype="float32", kernels="torch", block_size=16, kv_cache_memory=budget,
                         num_threads=1)
    assert plan.kv_bytes_per_token == runner.kv_bytes_per_token == 3 * 2 * 16 * 2 * 4
    assert runner.num_blocks == blocks_that_fit(budget, plan.kv_bytes_per_token, 16) == budget // (768 * 16)


def test_engine_pool_is_the_plans_arithmetic_smollm2(smollm2_gguf):
    plan = MemoryPlan(ModelShape.load(smollm2_gguf), context_len=8192, kv_dtype="fp32")
    runner = ModelRunner(smollm2_gguf, dtype="float32", kernels="torch", block_size=16, num_threads=1)
    assert plan.kv_bytes_per_token == runner.kv_bytes_per_token == 30 * 3 * 64 * 2 * 4
    assert runner.num_blocks == blocks_that_fit(1 << 30, plan.kv_bytes_per_token, 16)
