"""Quantized GGUF files served quantized: tiny random models written with Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 tensors
give, on the CPU kernels, the logits (so the greedy tokens) of a reference whose quantized matmuls and
embedding are the same math in plain torch, keep no float copy of a matmul weight, and report their bytes.

The reference keeps the CPU backend's other ops: x is quantized to int8 on the way into every
matmul, so a last-bit difference upstream (torch's RMSNorm against the C one) can move a value
across a rounding boundary and the two then part by more than any tie; with the same other ops,
the kernel and its reference agree bit for bit."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.model_runner import ModelRunner
from kernels import cpu_native, quant_linear
from kernels.quant_linear import QuantStack, QuantWeight
from tests.actors.test_loader_gguf import hf_folder_to_gguf

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no CPU C kernels here")

# The default model's mix (Q4_1 layers, a Q8_0 embedding), one type throughout, and the fifth-bit types.
MIXES = {"q4_1+q8_0": lambda name: Q.Q8_0 if name.startswith(("token_embd", "output.")) else Q.Q4_1,
         "q8_0": lambda name: Q.Q8_0, "q4_0": lambda name: Q.Q4_0,
         "q5_1+q5_0": lambda name: Q.Q5_0 if name.startswith(("token_embd", "output.")) else Q.Q5_1}


def _runner(path, kernels="cpu", quantization="auto"):
    return ModelRunner(path, dtype="float32", kernels=kernels, block_size=8, num_blocks=32, num_threads=2,
                       quantization=quantization)


def _reference(path) -> ModelRunner:
    runner = _runner(path)
    runner.model.ops = replace(runner.model.ops, linear=quant_linear.torch_linear,
                               embedding=quant_linear.torch_embedding)
    return runner


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2"])
def test_greedy_parity_with_the_torch_reference_of_the_same_math(arch, mix, tiny_model_dir, tmp_path):
    path = hf_folder_to_gguf(tiny_model_dir(arch), str(tmp_path / "model.gguf"), MIXES[mix])
    cpu, ref = _runner(path), _reference(path)
    for runner in (cpu, ref):
        model = runner.model
        layers = [w for layer in model.layers for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight,
                                                        layer.down_weight)]
        assert all(isinstance(w, QuantWeight) for w in layers + [model.lm_head, model.embed])
        assert (model.embed is model.lm_head) == (arch == "llama_tied")   # one copy when tied
    _assert_same_logits(cpu, ref)


def _assert_same_logits(cpu, ref) -> None:
    """Prefill (many rows at once, logits at every position), then 20 greedy decode steps, each runner
    fed the CPU path's own tokens: the logits equal at every step."""
    prompts = [list(range(3, 40)), [7, 8, 9, 300, 5]]
    batch = ForwardBatch([SequenceInput(prompts[0], 0, [0, 1, 2, 3, 4], num_logits=37),
                          SequenceInput(prompts[1], 0, [5], num_logits=5)])
    assert torch.equal(cpu.execute(batch), ref.execute(batch))
    seq, blocks = [11, 12, 13], [8, 9, 10, 11]
    got, want = (r.execute(ForwardBatch([SequenceInput(seq, 0, blocks, 1)])) for r in (cpu, ref))
    for _ in range(20):
        assert torch.equal(got, want)
        token = int(got[-1].argmax())
        step = ForwardBatch([SequenceInput([token], len(seq), blocks, 1)])
        seq.append(token)
        got, want = cpu.execute(step), ref.execute(step)


def _k_mix(v_type: Q):
    """A Q4_K_M-like mix: q, k, gate and up Q4_K, v `v_type` (Q6_K; Q5_0 where llama.cpp's rows are not
    whole super-blocks), down Q6_K, o Q5_K; embedding Q4_K, output Q6_K."""
    def mix(name: str) -> Q:
        if name.endswith("attn_output.weight"):
            return Q.Q5_K
        if name.endswith("attn_v.weight"):
            return v_type
        return Q.Q6_K if name.endswith(("ffn_down.weight", "output.weight")) else Q.Q4_K
    return mix


@pytest.mark.parametrize("v_type", [Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["llama_wide", "qwen2_wide"])
def test_k_quants_greedy_parity_with_the_torch_reference(arch, v_type, tiny_model_dir, tmp_path):
    from actors.model.gguf_file import GGUFFile
    from actors.worker.gguf_weights import GGUFWeights

    path = hf_folder_to_gguf(tiny_model_dir(arch), str(tmp_path / "model.gguf"), _k_mix(v_type))
    cpu, ref = _runner(path), _reference(path)
    model = cpu.model
    layer = model.layers[0]
    assert isinstance(layer.qkv_weight, QuantStack)            # Q4_K q and k, v packed apart: fused by rows
    assert [p.name for p in layer.qkv_weight.parts] == ["Q4_K", v_type.name]
    assert (layer.gate_up_weight.name, layer.o_weight.name, layer.down_weight.name) == ("Q4_K", "Q5_K", "Q6_K")
    assert model.embed.name == "Q4_K"
    assert model.lm_head.name == ("Q4_K" if arch == "llama_wide" else "Q6_K")   # tied: the embedding itself
    assert set(cpu.model.weight_bytes()) == {"Q4_K", "Q5_K", "Q6_K", v_type.name, "float"}
    vectors = [info.shape[0] for info in GGUFFile(path).tensors.values() if len(info.shape) == 1]
    assert cpu.model.weight_bytes()["float"] == 4 * sum(vectors)   # float32 norms and biases alone
    assert cpu.weight_bytes <= 1.15 * GGUFWeights(path).tensor_bytes()
    _assert_same_logits(cpu, ref)


def _iq4_mix(name: str) -> Q:
    """An IQ4_XS file: its matrices IQ4_XS, v IQ4_NL (llama.cpp's choice for rows not whole super-blocks), the
    output Q6_K."""
    if name.endswith("attn_v.weight"):
        return Q.IQ4_NL
    return Q.Q6_K if name.startswith("output.") else Q.IQ4_XS


@pytest.mark.parametrize("arch", ["llama_wide", "qwen2_wide"])
def test_iq4_greedy_parity_with_the_torch_reference(arch, tiny_model_dir, tmp_path):
    from actors.worker.gguf_weights import GGUFWeights

    path = hf_folder_to_gguf(tiny_model_dir(arch), str(tmp_path / "model.gguf"), _iq4_mix)
    assert GGUFWeights(path).dequantized_types() == {}           # every type read in its blocks
    cpu, ref = _runner(path), _reference(path)
    model = cpu.model
    layer = model.layers[0]
    assert [p.name for p in layer.qkv_weight.parts] == ["IQ4_XS", "IQ4_NL"]
    assert (layer.gate_up_weight.name, layer.o_weight.name, layer.down_weight.name) == ("IQ4_XS",) * 3
    assert model.embed.name == "IQ4_XS"
    assert model.lm_head.name == ("IQ4_XS" if arch == "llama_wide" else "Q6_K")   # tied: the embedding itself
    assert cpu.weight_bytes <= 1.15 * GGUFWeights(path).tensor_bytes()
    _assert_same_logits(cpu, ref)


def test_resident_bytes_are_the_files_and_none_dequantizes(tiny_model_dir, tmp_path):
    from actors.worker.gguf_weights import GGUFWeights

    path = hf_folder_to_gguf(tiny_model_dir("llama_tied"), str(tmp_path / "model.gguf"), MIXES["q4_1+q8_0"])
    quantized, dequantized = _runner(path), _runner(path, quantization="none")
    file_bytes = GGUFWeights(path).tensor_bytes()
    assert quantized.weight_bytes <= 1.15 * file_bytes      # 16-row groups pad nothing here
    assert not isinstance(dequantized.model.lm_head, QuantWeight)
    assert dequantized.weight_bytes > 4 * file_bytes        # float32: 4 bytes a value against ~0.6
    with pytest.raises(ValueError, match="quantization"):
        _runner(path, quantization="int3")
