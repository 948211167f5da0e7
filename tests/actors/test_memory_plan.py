"""The memory plan: the serving chapter's figure, the reverse question, and the engine's own pool."""
from __future__ import annotations

import pytest

from actors.model.memory_plan import GB, GIB, MemoryPlan, parse_size
from actors.model.value_bytes import GGUF_WEIGHT_BYTES
from actors.model.shape import PRESETS, ModelShape
from actors.worker.model_runner import ModelRunner


def blocks_that_fit(budget: int, bytes_per_token: float, block_size: int) -> int:
    """KV pool blocks of `block_size` tokens that `budget` bytes hold, by the plan's bytes a token."""
    return int(budget // (bytes_per_token * block_size))


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
    # Half the bytes a value, and the float32 scale of each 16-token block and KV head, for K and for V.
    assert q.kv_bytes_per_token == CHAPTER.kv_bytes_per_token / 2 + 80 * 8 * 2 * 4 / 16
    with pytest.raises(ValueError, match="unknown precision 'int3'"):
        MemoryPlan(CHAPTER.shape, 1024, weight_dtype="int3")


def test_gguf_types_are_sized_as_the_kernels_hold_them():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    from kernels import kquant

    for name, per_value in GGUF_WEIGHT_BYTES.items():
        qtype = Q[name.upper()]
        block, size = GGML_QUANT_SIZES[qtype]
        held = kquant.ROW_BYTES[qtype] if qtype in kquant.TYPES else size   # K-quants: scales a byte each
        assert per_value == held / block
    q4_1 = MemoryPlan(CHAPTER.shape, 1024, weight_dtype="q4_1")
    assert q4_1.weight_bytes == 70 * GB * 5 / 8                               # 5 bits a weight
    assert MemoryPlan(CHAPTER.shape, 1024, weight_dtype="q4_k").weight_bytes == 70 * GB * 4.625 / 8
    with pytest.raises(ValueError, match="GGUF file's own"):
        MemoryPlan(CHAPTER.shape, 1024, weight_dtype="auto")                  # a preset has no file types
    with pytest.raises(ValueError, match="unknown precision 'q4_k'"):
        MemoryPlan(CHAPTER.shape, 1024, kv_dtype="q4_k")


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


def test_engine_weights_are_the_plans_arithmetic_smollm2(smollm2_gguf):
    """The default model as it serves: Q4_1 layers and a Q8_0 embedding packed, float32 norms."""
    plan = MemoryPlan(ModelShape.load(smollm2_gguf), context_len=8192, weight_dtype="auto", activation_dtype="fp32")
    runner = ModelRunner(smollm2_gguf, dtype="float32", kernels="torch", block_size=16, num_threads=1,
                         num_blocks=4, quantization="auto")
    assert plan.weight_bytes == runner.weight_bytes == 96_576_768


@pytest.mark.parametrize("v_type", ["Q6_K", "Q5_0"])
def test_engine_weights_and_int8_pool_are_the_plans_arithmetic_k_quants(tiny_model_dir, tmp_path, v_type):
    """A Q4_K_M-like mix (q, k in Q4_K and v in Q6_K, or Q5_0 as llama.cpp stores it for widths not whole
    super-blocks, fused by rows; o in Q5_K), an int8 cache."""
    from gguf.constants import GGMLQuantizationType as Q

    from tests.actors.test_loader_gguf import hf_folder_to_gguf
    from tests.actors.test_quantized_gguf import _k_mix

    path = hf_folder_to_gguf(tiny_model_dir("qwen2_wide"), str(tmp_path / "model.gguf"), _k_mix(Q[v_type]))
    for kv in ("int8", "fp8"):
        plan = MemoryPlan(ModelShape.load(path), context_len=64, weight_dtype="auto", kv_dtype=kv,
                          activation_dtype="fp32")
        budget = 1_000_003
        runner = ModelRunner(path, dtype="float32", kernels="torch", block_size=16, kv_cache_memory=budget,
                             num_threads=1, kv_cache_dtype=kv, quantization="auto")
        assert plan.weight_bytes == runner.weight_bytes
        assert plan.kv_bytes_per_token == runner.kv_bytes_per_token
        assert runner.num_blocks == blocks_that_fit(budget, plan.kv_bytes_per_token, 16)


def test_the_plans_gguf_types_are_every_type_the_kernels_keep_packed():
    """model_bytes stays free of torch, so it keeps its own table: it must name each type the CPU kernels
    read, at the bytes they hold it in (a new kernel type without a planner entry fails here)."""
    from kernels import kquant, quant_linear

    held = {name.lower(): quant_linear.BLOCK_BYTES[t] / 32 for t, name in quant_linear.NAMES.items()
            if t in quant_linear.BLOCK_BYTES}
    held |= {t.name.lower(): kquant.ROW_BYTES[t] / 256 for t in kquant.TYPES}
    assert GGUF_WEIGHT_BYTES == held


def test_a_known_shape_is_its_tensors():
    """The layout the int8 / int4 plan walks adds up to the shape's parameter count."""
    from actors.model.memory_plan import float_params, matmul_shapes

    for name, shape in PRESETS.items():
        if shape.has_layout:
            assert sum(n * k for n, k, _ in matmul_shapes(shape)) + float_params(shape) == shape.num_params, name
    assert not PRESETS["70b-gqa"].has_layout            # a parameter count alone: nominal int8 / int4
    assert MemoryPlan(PRESETS["70b-gqa"], 1024, weight_dtype="int4").nominal_weights
    with pytest.raises(ValueError, match="backend must be one of"):
        MemoryPlan(PRESETS["70b-gqa"], 1024, backend="tpu")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama_bias"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("kernels,backend", [("cpu", "cpu"), ("torch", "gpu")])
def test_engine_int_weights_are_the_plans_arithmetic(tiny_model_dir, arch, quantization, kernels, backend):
    """--quantization int8 / int4 on a float checkpoint: per-channel and per-group scales, the int8 LM head
    (a tied embedding read out of it), an untied embedding, norms and biases in float; untied (llama, qwen2),
    tied (qwen3, llama_bias), q/k/v biases (qwen2), an o bias (llama_bias), q/k norms (qwen3)."""
    folder = tiny_model_dir(arch)
    plan = MemoryPlan(ModelShape.load(folder), context_len=64, weight_dtype=quantization, activation_dtype="fp32",
                      backend=backend)
    runner = ModelRunner(folder, dtype="float32", kernels=kernels, block_size=16, num_threads=1, num_blocks=4,
                         quantization=quantization)
    assert not plan.nominal_weights
    assert plan.weight_bytes == runner.weight_bytes
    nominal = plan.shape.num_params * (1 if quantization == "int8" else 0.5)
    assert plan.weight_bytes > nominal                  # the scales and the float tensors are counted


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_int_weights_are_the_plans_arithmetic_smollm2(smollm2_gguf, quantization):
    """The default model requantized at load, served in bfloat16 on the CPU kernels (the perplexity table's
    135.4 and 87.5 MB, and the int8 rows' sums the CPU's int8 kernel reads)."""
    plan = MemoryPlan(ModelShape.load(smollm2_gguf), context_len=64, weight_dtype=quantization, backend="cpu",
                      activation_dtype="bf16")
    runner = ModelRunner(smollm2_gguf, dtype="bfloat16", kernels="cpu", block_size=16, num_threads=1,
                         num_blocks=4, quantization=quantization)
    assert plan.weight_bytes == runner.weight_bytes == {"int8": 136_187_520, "int4": 87_665_280}[quantization]
