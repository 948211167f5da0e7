"""The K-quant CPU matmul (Q4_K, Q5_K, Q6_K in quant_gemm.c) and its layout (kernels/kquant.py): the packer
keeps the file's bits (unpacking gives the file's bytes back) and dequantizes as the gguf package does, bit
for bit; both builds (-march=native and AVX2) equal the torch reference of the same math bit for bit, and
dequantize-then-matmul in float32 within the error of quantizing x to int8 per block of 32.

The blocks come from tests/kquants.py, a small reference quantizer (gguf cannot write K-quants)."""

import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kernels import get_ops, kquant, quant_linear
from kernels.quant_linear import QuantStack, QuantTensor
from tests.kernels.test_quant_linear import _activation_bound as activation_bound
from tests.kernels.test_quant_linear import assert_unpacks_and_dequantizes_as_gguf
from tests.kquants import quantize

HAS_TOOLCHAIN = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("cc") is not None
pytestmark = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no AVX2 CPU or no C compiler")

TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
SHAPES = [(1, 256), (17, 512), (45, 768), (100, 256)]   # (N, K): N off the 16-row groups, 1 to 3 super-blocks


def _quantized(qtype, n, k, seed):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0, :256] = 0.0                                      # an all-zero super-block: d and dmin 0
    w[-1, 32:64] = np.abs(w[-1, 32:64]) + 1.0             # a sub-block with no negative value: min 0
    raw = quantize(w, qtype)
    return raw, quant_linear.pack(QuantTensor(int(qtype), torch.from_numpy(raw), k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", SHAPES)
def test_packing_keeps_the_file_bits_and_dequantizes_as_gguf_does(qtype, n, k):
    raw, weight = _quantized(qtype, n, k, n + k)
    groups = -(-n // 16)
    assert weight.shape == (n, k) and weight.nbytes == groups * 16 * k // 256 * kquant.ROW_BYTES[qtype]
    assert kquant.ROW_BYTES[qtype] <= 1.03 * kquant.BLOCK_BYTES[qtype]    # scales a byte each: no float copy
    assert_unpacks_and_dequantizes_as_gguf(weight, raw, qtype)


def _activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The Q4/Q8 kernels' bound (half of x's quantization step per block), plus float32 rounding of the
    super-blocks' scaled sums (2^-20 of the sum of |x| |w|)."""
    return activation_bound(x, w) + 2.0 ** -20 * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("m", [1, 3, 9, 40])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_the_reference_and_dequantize_then_matmul(each_build, qtype, m, n, k, poisoned_empty):
    raw, weight = _quantized(qtype, n, k, m * 1000 + n + k)
    gen = torch.Generator().manual_seed(m + n + k)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    x[0, 64:96] = 0.0                                      # a block of x of scale 0
    got = quant_linear.matmul(x, weight, bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.equal(got, quant_linear.reference_matmul(x, weight, bias))   # the same sequence, bit for bit
    w = torch.from_numpy(dequantize(raw, qtype))
    exact = x.double() @ w.double().T + bias.double()
    assert ((got.double() - exact).abs() <= _activation_bound(x, w) + 1e-4).all()
    got16 = quant_linear.matmul(x.to(torch.bfloat16), weight, bias)
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16, quant_linear.reference_matmul(x.to(torch.bfloat16), weight, bias))


def test_types_fused_by_rows_multiply_as_one_weight(each_build):
    """A K-quant mix's q and k in Q4_K, v in Q6_K: one stacked weight, its rows in order."""
    parts = [_quantized(qtype, n, 512, n)[1] for qtype, n in ((Q.Q4_K, 40), (Q.Q4_K, 24), (Q.Q6_K, 24))]
    fused = QuantTensor.cat([QuantTensor(int(Q.Q4_K), quant_linear.unpack(p), 512) for p in parts[:2]])
    stacked = quant_linear.stack([quant_linear.pack(fused), parts[2]])
    assert isinstance(stacked, QuantStack) and stacked.shape == (88, 512)
    x, bias = torch.randn(5, 512), torch.randn(88)
    cpu, ref = get_ops("cpu"), get_ops("torch")
    got = cpu.linear(x, stacked, bias)
    assert torch.equal(got, ref.linear(x, stacked, bias))
    one_by_one = torch.cat([quant_linear.matmul(x, p) for p in parts], dim=1) + bias
    assert torch.allclose(got, one_by_one, rtol=0, atol=1e-5)


def test_bad_input_is_refused():
    raw, weight = _quantized(Q.Q4_K, 4, 256, 2)
    with pytest.raises(ValueError, match="shapes"):
        quant_linear.matmul(torch.randn(2, 128), weight)
    with pytest.raises(ValueError, match="super-blocks"):
        quant_linear.pack(QuantTensor(int(Q.Q5_K), torch.from_numpy(raw), 256))   # Q4_K's bytes read as Q5_K
    with pytest.raises(ValueError, match="super-blocks"):
        quant_linear.pack(QuantTensor(int(Q.Q6_K), torch.zeros(4, 105, dtype=torch.uint8), 128))
