"""Float checkpoints quantized at load (--quantization int8 / int4) and a GPTQ int4 checkpoint served in its
own weights: greedy parity against a reference that applies the same quantized math in plain torch, no
float copy of a projection resident, the bytes reported, and clear errors for what is not served.

int8 multiplies exact integer products on both sides (torch._int_mm against float64), so its logits
equal the reference's bit for bit; int4's products are float sums in another order, so a greedy token
may differ from the reference's only where the reference's two best logits lie within 1e-4."""
from __future__ import annotations

import json
import zlib
from dataclasses import replace

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from actors.config import EngineConfig
from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.hf_weights import HFWeights
from actors.model.config import ModelLoadError
from actors.worker.model_runner import ModelRunner
from kernels import cpu_native, quant_matmul
from kernels.ops import TORCH_OPS
from kernels.quant_linear_cpu import Int4CpuWeight
from kernels.quantize import Int4Weight, Int8Weight, int4_group_size_for, quantize_int4
from tests.actors.test_awq_weights import awq_config, awq_dequantize, awq_tensors
from tests.actors.test_gptq_weights import PREFIX, _gptq_dequantize, _gptq_tensors
from tests.actors.test_loader_gguf import hf_folder_to_gguf

needs_cpu_kernels = pytest.mark.skipif(not cpu_native.available(), reason="no CPU C kernels here")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TIE = 1e-4


def _runner(path, quantization, kernels="cpu") -> ModelRunner:
    return ModelRunner(path, dtype="float32", kernels=kernels, block_size=8, num_blocks=32, num_threads=2,
                       quantization=quantization)


def _reference(path, quantization) -> ModelRunner:
    """The CPU runner with the torch backend's quantized matmuls and embedding, weights loaded again."""
    runner = _runner(path, quantization)
    runner.model.ops = replace(runner.model.ops, prepare_int=TORCH_OPS.prepare_int, linear=TORCH_OPS.linear,
                               embedding=TORCH_OPS.embedding)
    runner.model.load_weights(HFWeights(path), quantization=quantization)
    return runner


def _projections(model) -> list:
    return [w for layer in model.layers for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight,
                                                  layer.down_weight)]


def _steps(runners, num_steps=16):
    """Prefill logits at every position of two prompts, then greedy decode steps, each runner fed the
    first runner's tokens: yields the runners' logits of each step."""
    batch = ForwardBatch([SequenceInput(list(range(3, 40)), 0, [0, 1, 2, 3, 4], num_logits=37),
                          SequenceInput([7, 8, 9, 300, 5], 0, [5], num_logits=5)])
    yield [r.execute(batch) for r in runners]
    seq, blocks = [11, 12, 13], [8, 9, 10, 11]
    step = ForwardBatch([SequenceInput(seq, 0, blocks, 1)])
    for _ in range(num_steps):
        logits = [r.execute(step) for r in runners]
        yield logits
        token = int(logits[0][-1].argmax())
        step = ForwardBatch([SequenceInput([token], len(seq), blocks, 1)])
        seq.append(token)


def _assert_same_greedy(got: torch.Tensor, want: torch.Tensor) -> None:
    """Row by row: the same argmax, or the reference's logit of `got`'s choice within TIE of its best."""
    chosen = got.argmax(dim=-1)
    gap = want.max(dim=-1).values - want.gather(1, chosen[:, None])[:, 0]
    assert bool((gap <= TIE).all()), f"greedy tokens part beyond a tie: gaps {gap.tolist()}"


@needs_cpu_kernels
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2"])
def test_int8_logits_equal_the_reference_bit_for_bit(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    cpu, ref = _runner(path, "int8"), _reference(path, "int8")
    for runner in (cpu, ref):
        model = runner.model
        assert all(isinstance(w, Int8Weight) for w in _projections(model) + [model.lm_head])
        assert (model.embed is model.lm_head) == (arch == "llama_tied")   # one copy when tied
    for got, want in _steps([cpu, ref]):
        assert torch.equal(got, want)


@needs_cpu_kernels
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2"])
def test_int4_greedy_parity_with_the_reference(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    cpu, ref = _runner(path, "int4"), _reference(path, "int4")
    assert all(isinstance(w, Int4CpuWeight) for w in _projections(cpu.model))
    assert all(isinstance(w, Int4Weight) for w in _projections(ref.model))
    assert isinstance(cpu.model.lm_head, Int8Weight)     # the LM head (a tied embedding too) stays int8
    assert (cpu.model.embed is cpu.model.lm_head) == (arch == "llama_tied")
    for got, want in _steps([cpu, ref]):
        _assert_same_greedy(got, want)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=0)


@needs_cpu_kernels
def test_resident_bytes_hold_no_float_projection(tiny_model_dir):
    path = tiny_model_dir("llama_tied")
    cfg = _runner(path, "none").model_config
    shapes = [(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), (cfg.hidden_size, cfg.q_size),
              (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]
    head = (cfg.vocab_size, cfg.hidden_size)
    norms = 4 * (cfg.hidden_size * (2 * cfg.num_layers + 1))    # float32 RMSNorm weights, all that stays float
    int8_model = _runner(path, "int8").model
    int8 = int8_model.weight_bytes()
    per_row = 8 if int8_model.ops.backend == "cpu" else 4   # a scale, and on the CPU backend int8_gemm.c's row sum
    assert int8 == {"int8": sum(n * k + per_row * n for n, k in shapes * cfg.num_layers + [head]), "float": norms}
    int4 = _runner(path, "int4", kernels="torch")
    assert int4.model.weight_bytes() == {   # nibbles, then per group an fp16 scale and a uint8 zero point
        "int4": cfg.num_layers * sum(n * k // 2 + 3 * n * (k // int4_group_size_for(k)) for n, k in shapes),
        "int8": head[0] * head[1] + 4 * head[0], "float": norms}
    assert int4.weight_bytes == sum(int4.model.weight_bytes().values())


@needs_cpu_kernels
def test_gguf_file_is_dequantized_then_requantized(tiny_model_dir, tmp_path):
    path = hf_folder_to_gguf(tiny_model_dir("qwen2"), str(tmp_path / "model.gguf"), lambda name: Q.Q8_0)
    model = _runner(path, "int8").model
    assert all(isinstance(w, Int8Weight) for w in _projections(model) + [model.lm_head])


def test_bad_quantization_values_are_clear_errors(tiny_model_dir):
    path = tiny_model_dir("llama_tied")
    with pytest.raises(ValueError, match="quantization must be one of .*int8.*int4"):
        EngineConfig(model=path, quantization="int3")
    with pytest.raises(ValueError, match="quantization must be one of"):
        _runner(path, "fp4", kernels="torch")


def _int4_folder(source: str, folder, pack, dequantize, quantization_config: dict, group_size=32) -> tuple[str, str]:
    """A pre-quantized int4 checkpoint of `source`'s projections (`pack`(Int4Weight, prefix) -> its tensors),
    and beside it a float checkpoint of the weights the format's own formula (`dequantize`(tensors, prefix))
    reads out of it: (int4 folder, float folder)."""
    tensors = load_file(f"{source}/model.safetensors")
    int4, dequantized = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.removesuffix(".weight").endswith(PROJECTIONS)]:
        prefix = name.removesuffix(".weight")
        packed = pack(quantize_int4(tensors[name], group_size), prefix)
        dequantized[name] = dequantize(packed, prefix).contiguous()
        del int4[name]
        int4.update(packed)
    config = json.loads(open(f"{source}/config.json").read())
    paths = []
    for kind, weights, extra in [("int4", int4, {"quantization_config": quantization_config}),
                                 ("float", dequantized, {})]:
        out = folder / kind
        out.mkdir()
        (out / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(weights, str(out / "model.safetensors"))
        paths.append(str(out))
    return paths[0], paths[1]


def _gptq_folder(source: str, folder, group_size=32, desc_act=False) -> tuple[str, str]:
    """A GPTQ checkpoint (original format) and the float weights AutoGPTQ's formula reads out of it. With
    desc_act, each projection quantized in an activation order of its own, shared by the projections
    that read one input (q, k and v; gate and up), as GPTQ's statistics of that input make it."""
    def pack(weight, prefix):
        order = None
        if desc_act:
            reads = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            seed = torch.Generator().manual_seed(zlib.crc32(reads.encode()))
            order = torch.randperm(weight.in_features, generator=seed)
            unordered = quant_matmul.dequantize_int4(weight)
            weight = quantize_int4(unordered[:, order], group_size)   # the inputs quantized in that order
        return {key.replace(PREFIX, prefix): value
                for key, value in _gptq_tensors(weight, zero_offset=1, order=order).items()}

    def dequantize(packed, prefix):
        return _gptq_dequantize({key.replace(prefix, PREFIX): value for key, value in packed.items()}, zero_offset=1)
    return _int4_folder(source, folder, pack, dequantize, {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                                           "desc_act": desc_act, "sym": False}, group_size)


def _served_like_its_floats(int4: str, dequantized: str, kernels: str, method: str) -> None:
    served, reference = _runner(int4, "auto", kernels), _runner(dequantized, "none", "torch")
    kind = Int4CpuWeight if kernels == "cpu" else Int4Weight
    assert all(isinstance(w, kind) for w in _projections(served.model))
    assert served.weight_bytes < reference.weight_bytes / 2
    for got, want in _steps([served, reference]):
        _assert_same_greedy(got, want)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    for quantization in ("none", "int8"):
        with pytest.raises(ModelLoadError, match=f"{method} checkpoint is served in its own int4 weights"):
            _runner(int4, quantization, kernels)


@pytest.mark.parametrize("kernels", ["torch", pytest.param("cpu", marks=needs_cpu_kernels)])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_checkpoint_serves_its_int4_weights(kernels, desc_act, tiny_model_dir, tmp_path):
    _served_like_its_floats(*_gptq_folder(tiny_model_dir("llama"), tmp_path, desc_act=desc_act), kernels, "GPTQ")


@pytest.mark.parametrize("kernels", ["torch", pytest.param("cpu", marks=needs_cpu_kernels)])
def test_awq_checkpoint_serves_its_int4_weights(kernels, tiny_model_dir, tmp_path):
    folders = _int4_folder(tiny_model_dir("llama"), tmp_path, awq_tensors, awq_dequantize, awq_config(32))
    _served_like_its_floats(*folders, kernels, "AWQ")
