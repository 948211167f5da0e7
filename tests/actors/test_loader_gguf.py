"""GGUF loading: tiny models written as GGUF the way llama.cpp's converter writes them load to the
same logits as their safetensors originals; the default SmolLM2 GGUF's metadata reads correctly.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from safetensors.torch import load_file

from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.gguf_weights import GGUFWeights
from actors.model.config import read_hf_config
from actors.model.config import ModelLoadError
from actors.worker.model_runner import ModelRunner

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute: interleave the two rotary halves of each head.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_freq_factors(cfg) -> np.ndarray:
    # convert_hf_to_gguf.py's Llama-3 rope_freqs: one divisor per rotary frequency.
    s = cfg.rope_scaling
    factor, low, high, old = s["factor"], s["low_freq_factor"], s["high_freq_factor"], \
        s["original_max_position_embeddings"]
    out = []
    for i in range(0, cfg.head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / cfg.rope_theta ** (i / cfg.head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_folder_to_gguf(folder: str, path: str, quantize=None) -> str:
    """Writes a float32 GGUF of a tiny llama/qwen2 HF folder, as llama.cpp's converter would;
    `quantize(gguf_name)` may name a GGMLQuantizationType for a 2-D tensor, stored as such (K-quants
    through the tests' own quantizer, which gguf lacks)."""
    import gguf

    from tests.kquants import quantize as quantize_to

    cfg = read_hf_config(folder)
    arch = cfg.family
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(2)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    for name, t in tensors.items():
        a = t.numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{_LAYER[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                a = _llamacpp_permute(a, cfg.num_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                a = _llamacpp_permute(a, cfg.num_kv_heads)
        qtype = quantize(gname) if quantize is not None and a.ndim == 2 else None
        if qtype is None:
            w.add_tensor(gname, np.ascontiguousarray(a))
        else:
            w.add_tensor(gname, quantize_to(np.ascontiguousarray(a, dtype=np.float32), qtype), raw_dtype=qtype)
    if cfg.rope_scaling:
        w.add_tensor("rope_freqs.weight", _llama3_freq_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    items, next_block = [], 0
    for p in prompts:
        n = -(-len(p) // runner.block_size)
        items.append(SequenceInput(p, 0, list(range(next_block, next_block + n)), num_logits=len(p)))
        next_block += n
    return runner.execute(ForwardBatch(items))


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2"])
def test_gguf_of_a_tiny_model_matches_its_safetensors(arch, tiny_model_dir, tmp_path):
    folder = tiny_model_dir(arch)
    gguf_path = hf_folder_to_gguf(folder, str(tmp_path / f"{arch}.gguf"))
    prompts = [[5, 9, 200, 31, 7, 7, 100, 3, 250, 11, 42], list(range(20, 120))]
    from_hf = ModelRunner(folder, kernels="torch", num_threads=1, block_size=16, num_blocks=16)
    from_gguf = ModelRunner(gguf_path, kernels="torch", num_threads=1, block_size=16, num_blocks=16)
    cfg_hf, cfg_gguf = from_hf.model_config, from_gguf.model_config
    assert (cfg_gguf.num_heads, cfg_gguf.num_kv_heads, cfg_gguf.head_dim, cfg_gguf.tie_word_embeddings) == \
        (cfg_hf.num_heads, cfg_hf.num_kv_heads, cfg_hf.head_dim, cfg_hf.tie_word_embeddings)
    torch.testing.assert_close(_logits(from_gguf, prompts), _logits(from_hf, prompts), rtol=1e-4, atol=1e-4)


def test_a_float16_gguf_keeps_its_matmul_weights_in_float16(tiny_model_dir, tmp_path):
    """An F16 GGUF (llama.cpp's converter's default type) under float32 activations on the CPU kernels: its matmul
    weights stay float16 in memory (packed), and the logits are those of the same values widened to float32 (the
    safetensors in float16, through torch's ops)."""
    import shutil

    from safetensors.torch import save_file

    from kernels.packed_linear import PackedWeight

    folder = tmp_path / "f16"
    shutil.copytree(tiny_model_dir("llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({n: t.half() if t.dim() == 2 else t for n, t in tensors.items()}, folder / "model.safetensors")
    gguf_path = hf_folder_to_gguf(str(folder), str(tmp_path / "f16.gguf"))
    assert GGUFWeights(gguf_path).stored_dtype("model.layers.0.mlp.down_proj.weight") == torch.float16
    prompts = [[5, 9, 200, 31, 7, 7, 100, 3, 250, 11, 42], list(range(20, 120))]
    from_gguf = ModelRunner(gguf_path, dtype="float32", kernels="cpu", num_threads=2, block_size=16, num_blocks=16)
    layer = from_gguf.model.layers[1]
    assert all(isinstance(w, PackedWeight) and w.half
               for w in (layer.qkv_weight, layer.gate_up_weight, layer.down_weight))
    widened = ModelRunner(str(folder), dtype="float32", kernels="torch", num_threads=2, block_size=16, num_blocks=16)
    assert widened.model.layers[1].down_weight.dtype == torch.float32
    torch.testing.assert_close(_logits(from_gguf, prompts), _logits(widened, prompts), rtol=1e-4, atol=1e-4)


def test_gguf_missing_tensor_and_unsupported_arch(tiny_model_dir, tmp_path):
    import gguf

    for arch in ("phi2", "qwen3"):   # Qwen3 loads from a folder only (the README says so)
        path = str(tmp_path / f"{arch}.gguf")
        w = gguf.GGUFWriter(path, arch)
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.ones((4, 4), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ModelLoadError, match=f"unsupported GGUF architecture '{arch}'"):
            ModelRunner(path, kernels="torch", num_threads=1, num_blocks=4)

    full = hf_folder_to_gguf(tiny_model_dir("qwen2"), str(tmp_path / "full.gguf"))
    reader = gguf.GGUFReader(full)
    cut = str(tmp_path / "cut.gguf")
    w = gguf.GGUFWriter(cut, "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("qwen2.") or field.name == "tokenizer.ggml.eos_token_id":
            w.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        if t.name != "blk.1.attn_v.bias":
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="lacks the tensor 'blk.1.attn_v.bias'"):
        ModelRunner(cut, kernels="torch", num_threads=1, num_blocks=4)


def test_smollm2_gguf_config(smollm2_gguf):
    weights = GGUFWeights(smollm2_gguf)
    cfg = weights.config
    assert cfg.family == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.max_position_embeddings) == (49152, 1536, 8192)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,)
    q = weights.get("model.layers.0.self_attn.q_proj.weight", torch.float32)
    assert q.shape == (576, 576) and torch.isfinite(q).all()


def test_lean_reader_agrees_with_gguf_reader(tiny_model_dir, tmp_path, smollm2_gguf):
    import gguf

    from actors.model.gguf_file import GGUFFile

    path = hf_folder_to_gguf(tiny_model_dir("llama"), str(tmp_path / "llama.gguf"))
    lean, reader = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert lean.metadata[key] == pytest.approx(field.contents()), key
    assert set(lean.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        ours = gguf.quants.dequantize(lean.raw(t.name), gguf.GGMLQuantizationType(lean.tensors[t.name].qtype))
        np.testing.assert_array_equal(ours, gguf.quants.dequantize(t.data, t.tensor_type))
    # The real vocabulary is counted, not decoded; the quantized tensors dequantize to full shape.
    real = GGUFFile(smollm2_gguf)
    assert len(real.metadata["tokenizer.ggml.tokens"]) == 49152
    assert "{% for message in messages %}" in real.metadata["tokenizer.chat_template"]
    emb = gguf.quants.dequantize(real.raw("token_embd.weight"), gguf.GGMLQuantizationType.Q8_0)
    assert emb.shape == (49152, 576)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"])  # BF16: the fallback path
def test_fast_dequantize_equals_gguf(qtype):
    import gguf

    from actors.worker.dequant import dequantize
    from tests.kquants import quantize

    q = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.5, size=(48, 512)).astype(np.float32)
    raw = quantize(weights, q)
    ours = dequantize(raw, q)
    assert ours.dtype == np.float32 and ours.shape == weights.shape
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, q))
    assert np.abs(ours - weights).max() < 0.2  # and it is the weights, roughly


def test_fast_dequantize_on_the_real_file(smollm2_gguf):
    import gguf

    from actors.worker.dequant import dequantize
    from actors.model.gguf_file import GGUFFile

    f = GGUFFile(smollm2_gguf)
    for name in ("token_embd.weight", "blk.3.attn_q.weight", "blk.29.ffn_down.weight", "blk.0.attn_norm.weight"):
        q = gguf.GGMLQuantizationType(f.tensors[name].qtype)
        np.testing.assert_array_equal(dequantize(f.raw(name), q), gguf.quants.dequantize(f.raw(name), q))


def test_a_type_no_kernel_reads_loads_dequantized_and_is_named(tiny_model_dir, tmp_path):
    """A GGUF whose MLP down matrices are MXFP4 (no kernel reads it in its blocks) loads them dequantized under
    --quantization auto, says so once naming the type and its bytes, and computes what the same file gives with
    every weight dequantized, bit for bit (its other matrices are float32)."""
    from structlog.testing import capture_logs

    from kernels import cpu_native

    if not cpu_native.available():
        pytest.skip("GGUF blocks stay packed only under the CPU's C kernels")
    down = lambda name: Q.MXFP4 if name.endswith("ffn_down.weight") else None   # noqa: E731
    path = hf_folder_to_gguf(tiny_model_dir("llama"), str(tmp_path / "mixed.gguf"), quantize=down)
    with capture_logs() as logs:
        packed = ModelRunner(path, kernels="cpu", num_threads=1, block_size=16, num_blocks=16, quantization="auto")
    named = [e for e in logs if e["event"].startswith("GGUF tensors dequantized at load")]
    assert len(named) == 1 and list(named[0]["file_bytes_by_type"]) == ["MXFP4"]
    assert named[0]["file_bytes_by_type"]["MXFP4"] > 0 and named[0]["log_level"] == "warning"
    with capture_logs() as logs:
        floats = ModelRunner(path, kernels="cpu", num_threads=1, block_size=16, num_blocks=16, quantization="none")
    assert not [e for e in logs if e["event"].startswith("GGUF tensors dequantized at load")]
    prompts = [[5, 9, 200, 31, 7, 7, 100, 3, 250, 11, 42]]
    assert torch.equal(_logits(packed, prompts), _logits(floats, prompts))
