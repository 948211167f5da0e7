"""A GPTQ int4 checkpoint written here (random weights quantized by kernels.quantize, packed into
AutoGPTQ's tensors) loads back into the Int4Weight it came from, bit-exact."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from actors.worker.gptq_weights import GPTQConfig, GPTQWeights
from actors.model.config import ModelLoadError
from kernels import quant_linear_cpu, quant_matmul
from kernels.quantize import quantize_int4, unpack_nibbles

PREFIX = "model.layers.0.self_attn.q_proj"


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 with the same bits (the top nibble makes many negative)."""
    return ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def _pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...], value j in bits 4j..4j+3."""
    return _int32((nibbles.long() << (4 * torch.arange(8))).sum(-1))


def _gptq_tensors(weight, zero_offset: int, order: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """`weight`'s GPTQ tensors; with `order`, quantized in activation order: weight's column j (group
    j // G) is input order[j]."""
    q = unpack_nibbles(weight.qweight).t()                       # [K, N]
    k, n = q.shape
    g_idx = torch.arange(k) // weight.group_size
    if order is not None:
        q, g_idx = torch.empty_like(q).index_copy_(0, order, q), torch.empty_like(g_idx).index_copy_(0, order, g_idx)
    zero = weight.zero.long() if weight.zero is not None else torch.full(weight.scale.shape, 8)
    stored_zero = (zero.t() - zero_offset) & 0xF                  # [K // G, N]; 0 - 1 wraps to 15
    return {
        f"{PREFIX}.qweight": _pack_words(q.reshape(k // 8, 8, n).transpose(1, 2)),
        f"{PREFIX}.qzeros": _pack_words(stored_zero.reshape(k // weight.group_size, n // 8, 8)),
        f"{PREFIX}.scales": weight.scale.t().contiguous(),
        f"{PREFIX}.g_idx": g_idx.to(torch.int32),
    }


def _gptq_dequantize(tensors, zero_offset: int) -> torch.Tensor:
    """AutoGPTQ's own formula on the stored tensors: scales[g_idx] * (q - (zeros + offset)[g_idx])."""
    shifts = torch.arange(0, 32, 4)
    qweight, qzeros = tensors[f"{PREFIX}.qweight"].long(), tensors[f"{PREFIX}.qzeros"].long()
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])
    zeros = ((qzeros[:, :, None] >> shifts) & 0xF).reshape(qzeros.shape[0], -1) + zero_offset
    g_idx = tensors[f"{PREFIX}.g_idx"].long()
    return (tensors[f"{PREFIX}.scales"].float()[g_idx] * (q - zeros[g_idx]).float()).t()


def _checkpoint(tmp_path, tensors, **quantization) -> str:
    config = {"architectures": ["LlamaForCausalLM"],
              "quantization_config": {"quant_method": "gptq", "bits": 4, "desc_act": False, **quantization}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({**tensors, "model.norm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def _weight(n=48, k=256, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5
    w[0, :64] = w[0, :64].abs()     # one-signed groups: an asymmetric zero point of 0
    return w


@pytest.mark.parametrize("symmetric", [True, False])
def test_original_format_loads_bit_exact(tmp_path, symmetric):
    original = quantize_int4(_weight(), 32, symmetric=symmetric)
    tensors = _gptq_tensors(original, zero_offset=1)
    weights = GPTQWeights(_checkpoint(tmp_path, tensors, group_size=32, sym=symmetric))
    assert weights.is_quantized(PREFIX) and not weights.is_quantized("model.norm")
    loaded = weights.linear(PREFIX)
    assert bool((loaded.zero == 16).any()) == (not symmetric)
    assert torch.equal(loaded.qweight, original.qweight) and torch.equal(loaded.scale, original.scale)
    # GPTQ's formula, zero points wrapped where a stored zero of -1 became 15 (then 16).
    assert torch.equal(quant_matmul.dequantize_int4(loaded), _gptq_dequantize(tensors, zero_offset=1))
    if symmetric:
        assert torch.equal(quant_matmul.dequantize_int4(loaded), quant_matmul.dequantize_int4(original))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    out = quant_linear_cpu.linear(x, quant_linear_cpu.prepare_int4(loaded, torch.float32))
    torch.testing.assert_close(out, x @ _gptq_dequantize(tensors, 1).t(), atol=1e-5, rtol=0)
    assert torch.equal(weights.get("model.norm.weight", torch.float32), torch.ones(64))


def test_v2_format_keeps_every_zero_point(tmp_path):
    original = quantize_int4(_weight(seed=1), 64)
    assert int(original.zero.min()) == 0   # which the original format cannot store
    tensors = _gptq_tensors(original, zero_offset=0)
    loaded = GPTQWeights(_checkpoint(tmp_path, tensors, group_size=64, checkpoint_format="gptq_v2")).linear(PREFIX)
    assert loaded.group_size == 64
    for field in ("qweight", "scale", "zero"):
        assert torch.equal(getattr(loaded, field), getattr(original, field)), field


def test_one_group_over_all_inputs(tmp_path):
    original = quantize_int4(_weight(k=128), 128)
    tensors = _gptq_tensors(original, zero_offset=1)
    del tensors[f"{PREFIX}.g_idx"]     # optional: inputs then go to groups in order
    loaded = GPTQWeights(_checkpoint(tmp_path, tensors, group_size=-1)).linear(PREFIX)
    assert loaded.group_size == 128 and torch.equal(loaded.qweight, original.qweight)


@pytest.mark.parametrize("group_size", [32, 64])
def test_activation_order_reads_its_inputs_in_that_order(tmp_path, group_size):
    """desc_act: input order[j] was quantized j-th, in group j // G; the loaded weight sorts the inputs by
    group and reads x in that order: its products are those of AutoGPTQ's formula."""
    w = _weight()
    order = torch.randperm(256, generator=torch.Generator().manual_seed(2))
    tensors = _gptq_tensors(quantize_int4(w[:, order], group_size), zero_offset=1, order=order)
    loaded = GPTQWeights(_checkpoint(tmp_path, tensors, group_size=group_size, desc_act=True)).linear(PREFIX)
    assert loaded.order is not None and sorted(loaded.order.tolist()) == list(range(256))
    reference = _gptq_dequantize(tensors, zero_offset=1)
    assert torch.equal(quant_matmul.dequantize_int4(loaded), reference)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(quant_matmul.linear(x, loaded), x @ reference.t(), atol=1e-5, rtol=0)
    out = quant_linear_cpu.linear(x, quant_linear_cpu.prepare_int4(loaded, torch.float32))
    torch.testing.assert_close(out, x @ reference.t(), atol=1e-5, rtol=0)
    rows = torch.tensor([[3, 0], [47, 3]])   # a tied embedding reads the rows in the inputs' own order
    assert torch.equal(quant_matmul.embedding(rows, loaded), reference[rows])


def test_unsupported_checkpoints_are_clear_errors(tmp_path):
    original = quantize_int4(_weight(), 32)
    tensors = _gptq_tensors(original, zero_offset=1)
    folder = _checkpoint(tmp_path, tensors, group_size=32)
    tensors[f"{PREFIX}.g_idx"] = (torch.arange(256) % 7).to(torch.int32)   # groups of other sizes
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="does not put 32 inputs in each of 8 groups"):
        GPTQWeights(folder).linear(PREFIX)
    with pytest.raises(ModelLoadError, match="do not fit together"):
        GPTQWeights(_checkpoint(tmp_path, tensors, group_size=64)).linear(PREFIX)
    for quantization, message in [({"bits": 8}, "8 bits"), ({"quant_method": "awq"}, "'awq' is not supported"),
                                  ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'")]:
        _checkpoint(tmp_path, tensors, group_size=32, **quantization)
        with pytest.raises(ModelLoadError, match=message):
            GPTQWeights(folder)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert GPTQConfig.from_folder(folder) is None
    with pytest.raises(ModelLoadError, match="not a GPTQ checkpoint"):
        GPTQWeights(folder)
