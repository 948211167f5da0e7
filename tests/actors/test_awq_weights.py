"""An AWQ int4 checkpoint written here (random weights quantized by kernels.quantize, packed into
AutoAWQ's GEMM tensors) loads back into the Int4Weight it came from, bit-exact; the values read back
are those AWQ's own formula gives (unpacked with the shifts vLLM's AWQ kernels use)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from actors.worker.awq_weights import PACK_ORDER, AWQConfig, AWQWeights
from actors.model.config import ModelLoadError
from kernels import quant_linear_cpu, quant_matmul
from kernels.quantize import quantize_int4, unpack_nibbles
from tests.actors.test_gptq_weights import _int32

PREFIX = "model.layers.0.mlp.down_proj"


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] values 0..15 -> int32 [R, N // 8] as AutoAWQ packs them: nibble j of word i holds column
    8i + PACK_ORDER[j]."""
    r, n = values.shape
    grouped = values.long().reshape(r, n // 8, 8)[..., list(PACK_ORDER)]
    return _int32((grouped << (4 * torch.arange(8))).sum(-1))


def awq_tensors(weight, prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """An asymmetric Int4Weight ([N, K]) as AWQ's qweight, qzeros and scales."""
    return {f"{prefix}.qweight": _pack_awq(unpack_nibbles(weight.qweight).t()),
            f"{prefix}.qzeros": _pack_awq(weight.zero.t()),
            f"{prefix}.scales": weight.scale.t().contiguous()}


def awq_dequantize(tensors, prefix: str = PREFIX) -> torch.Tensor:
    """[N, K] float32 by AWQ's formula, (q - zero) * scale per group, unpacked as vLLM's AWQ dequantize
    kernel does: column j of each 8 from bits AWQ_REVERSE_ORDER[j] * 4."""
    shifts = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]) * 4
    qweight, qzeros = tensors[f"{prefix}.qweight"].long(), tensors[f"{prefix}.qzeros"].long()
    q = ((qweight[..., None] >> shifts) & 0xF).reshape(qweight.shape[0], -1)
    zeros = ((qzeros[..., None] >> shifts) & 0xF).reshape(qzeros.shape[0], -1)
    scales = tensors[f"{prefix}.scales"].float()
    group = q.shape[0] // scales.shape[0]
    return ((q - zeros.repeat_interleave(group, 0)).float() * scales.repeat_interleave(group, 0)).t()


def awq_config(group_size: int, **changed) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            **changed}


def _checkpoint(tmp_path, tensors, **quantization) -> str:
    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": quantization}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({**tensors, "model.norm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def _weight(n=48, k=256, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5
    w[0] = w[0].abs()     # one-signed groups: a zero point of 0
    return w


@pytest.mark.parametrize("group_size", [32, 128])
def test_loads_bit_exact(tmp_path, group_size):
    original = quantize_int4(_weight(), group_size)
    assert int(original.zero.min()) == 0 and int(original.zero.max()) > 8
    tensors = awq_tensors(original)
    weights = AWQWeights(_checkpoint(tmp_path, tensors, **awq_config(group_size)))
    assert weights.is_quantized(PREFIX) and not weights.is_quantized("model.norm")
    loaded = weights.linear(PREFIX)
    assert loaded.group_size == group_size
    for field in ("qweight", "scale", "zero"):
        assert torch.equal(getattr(loaded, field), getattr(original, field)), field
    assert torch.equal(quant_matmul.dequantize_int4(loaded), awq_dequantize(tensors))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    out = quant_linear_cpu.linear(x, quant_linear_cpu.prepare_int4(loaded, torch.float32))
    torch.testing.assert_close(out, x @ awq_dequantize(tensors).t(), atol=1e-5, rtol=0)
    assert torch.equal(weights.get("model.norm.weight", torch.float32), torch.ones(64))


def test_autoawqs_own_config_keys(tmp_path):
    original = quantize_int4(_weight(), 64)
    folder = _checkpoint(tmp_path, awq_tensors(original), quant_method="awq", w_bit=4, q_group_size=64,
                         zero_point=True, version="GEMM")
    assert AWQConfig.from_folder(folder).group_size == 64
    assert torch.equal(AWQWeights(folder).linear(PREFIX).qweight, original.qweight)


def test_unsupported_checkpoints_are_clear_errors(tmp_path):
    tensors = awq_tensors(quantize_int4(_weight(), 32))
    folder = _checkpoint(tmp_path, tensors, **awq_config(64))
    with pytest.raises(ModelLoadError, match="do not fit together"):
        AWQWeights(folder).linear(PREFIX)
    for quantization, message in [({"bits": 8}, "8 bits"), ({"version": "gemv"}, "version 'gemv'"),
                                  ({"zero_point": False}, "without zero points"), ({"group_size": 0}, "group_size")]:
        _checkpoint(tmp_path, tensors, **{**awq_config(32), **quantization})
        with pytest.raises(ModelLoadError, match=message):
            AWQWeights(folder)
    _checkpoint(tmp_path, tensors, quant_method="gptq", bits=4, group_size=32)
    assert AWQConfig.from_folder(folder) is None
    with pytest.raises(ModelLoadError, match="not an AWQ checkpoint"):
        AWQWeights(folder)
