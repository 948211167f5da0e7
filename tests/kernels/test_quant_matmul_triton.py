"""The Triton W8A16 / W4A16 kernel against dequantize-then-matmul in float32 (quant_matmul.py).

Weights have std K^-1/2, so outputs are of order 1 and the tolerances are absolute: float32
activations 2e-5 (the same products summed in another order); float16 3e-3, which covers
the weight tile rounded to float16 (2^-11 relative) and the output rounded once more.
"""

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants

from kernels import quant_matmul
from kernels.quantize import GGMLType, GGUFWeight, Int4Weight, quantize_int4, quantize_int8
from tests.kernels.conftest import DEVICE

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
# Format -> (quantizer, K): K is a multiple of the group (32 for GGUF blocks), and for groups
# of 32 not of the kernel's 64-wide K tile.
FORMATS = {
    "int8": (quantize_int8, 100),
    "int4_g32": (lambda w: quantize_int4(w, 32), 160),
    "int4_g64_sym": (lambda w: quantize_int4(w, 64, symmetric=True), 192),
    "int4_g128": (lambda w: quantize_int4(w, 128), 256),
    "q8_0": (lambda w: _gguf(w, GGMLType.Q8_0), 160),
    "q4_0": (lambda w: _gguf(w, GGMLType.Q4_0), 160),
    "q4_1": (lambda w: _gguf(w, GGMLType.Q4_1), 224),
}


def _gguf(weight, qtype):
    raw = gguf_quants.quantize(weight.numpy(), qtype)
    return GGUFWeight(torch.from_numpy(raw), qtype)


def _weight(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * k ** -0.5


def _to_device(weight):
    fields = {name: getattr(weight, name) for name in weight.__dataclass_fields__}
    return type(weight)(**{name: v.to(DEVICE) if torch.is_tensor(v) else v for name, v in fields.items()})


@pytest.fixture(scope="module")
def kernel():
    from kernels import quant_matmul_triton

    return quant_matmul_triton.linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kernel_matches_dequantize_then_matmul(kernel, poisoned_empty, fmt, m, dtype):
    quantize, k = FORMATS[fmt]
    weight = quantize(_weight(47, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = quant_matmul.linear(x.float(), weight)
    out = kernel(x.to(DEVICE), _to_device(weight))
    assert out.dtype == dtype and out.shape == (m, 47)
    torch.testing.assert_close(out.cpu().float(), expected, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("fmt", ["int8", "int4_g32", "q4_1"])
def test_split_k_with_bias(kernel, poisoned_empty, fmt):
    # K cut into three ranges whose float32 partials are summed; the bias is added once.
    quantize, k = FORMATS[fmt]
    weight = quantize(_weight(70, k, seed=2))
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(70, generator=torch.Generator().manual_seed(4))
    expected = quant_matmul.linear(x, weight, bias)
    for splits in (1, 3):
        out = kernel(x.to(DEVICE), _to_device(weight), bias.to(DEVICE), num_splits=splits)
        torch.testing.assert_close(out.cpu(), expected, atol=TOL[torch.float32], rtol=0)


def test_mismatched_shapes_are_a_clear_error(kernel):
    weight = _to_device(quantize_int8(_weight(8, 64)))
    with pytest.raises(ValueError, match="shapes do not match"):
        kernel(torch.zeros(2, 32, device=DEVICE), weight)


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1])
def test_gguf_reference_dequantizes_as_the_gguf_package_does(qtype):
    raw = gguf_quants.quantize(_weight(5, 96).numpy(), qtype)
    ours = quant_matmul.dequantize_gguf(GGUFWeight(torch.from_numpy(raw), qtype))
    theirs = torch.from_numpy(np.asarray(gguf_quants.dequantize(raw, qtype), dtype=np.float32))
    assert torch.equal(ours, theirs)


def test_int4_group_larger_than_the_tile(kernel, poisoned_empty):
    # One group over all 192 inputs (GPTQ's group_size -1): each 64-wide tile lies inside it.
    weight = quantize_int4(_weight(20, 192), 64)
    one_group = Int4Weight(weight.qweight, weight.scale[:, :1].contiguous(), weight.zero[:, :1].contiguous(), 192)
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(kernel(x.to(DEVICE), _to_device(one_group)).cpu(), quant_matmul.linear(x, one_group),
                               atol=TOL[torch.float32], rtol=0)
    odd = Int4Weight(weight.qweight, weight.scale[:, :2].contiguous(), None, 96)
    with pytest.raises(ValueError, match="groups of 96"):
        kernel(x.to(DEVICE), _to_device(odd))


def test_int4_in_activation_order(kernel, poisoned_empty):
    # A GPTQ desc_act weight: column j multiplies input order[j]; the kernel reads x in that order.
    order = torch.randperm(160, generator=torch.Generator().manual_seed(6))
    sorted_weight = quantize_int4(_weight(33, 160)[:, order], 32)
    weight = Int4Weight(sorted_weight.qweight, sorted_weight.scale, sorted_weight.zero, 32, order)
    x = torch.randn(4, 160, generator=torch.Generator().manual_seed(7))
    expected = x @ quant_matmul.dequantize_int4(weight).t()
    torch.testing.assert_close(quant_matmul.linear(x, weight), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(x[:, order] @ quant_matmul.dequantize_int4(sorted_weight).t(), expected,
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(kernel(x.to(DEVICE), _to_device(weight)).cpu(), expected,
                               atol=TOL[torch.float32], rtol=0)
