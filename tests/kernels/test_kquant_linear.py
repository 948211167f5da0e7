"""The K-quant CPU matmul (Q4_K, Q5_K, Q6_K and IQ4_XS in quant_gemm.c) and its layout (kernels/kquant.py): the packer
keeps the file's bits (unpacking gives the file's bytes back) and dequantizes as the gguf package does, bit
for bit; both builds (-march=native and AVX2) equal the torch reference of the same math bit for bit (x
quantized per super-block of 256, llama.cpp's Q8_K, the sums integer within a super-block), and
dequantize-then-matmul in float32 within the error of quantizing x to int8 per super-block.

The blocks come from tests/kquants.py, a small reference quantizer (gguf cannot write K-quants; it writes
the Q5_0 and Q5_1 parts fused with them)."""

import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kernels import get_ops, kquant, quant_linear
from kernels.quant_linear import QuantStack, QuantTensor
from tests.kernels.test_quant_linear import assert_embedding_rows_in_c, assert_unpacks_and_dequantizes_as_gguf
from tests.kquants import quantize

HAS_TOOLCHAIN = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("cc") is not None
pytestmark = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no AVX2 CPU or no C compiler")

TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]
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
    """Each x is off by at most half its super-block's step (amax / 254), plus float32 rounding of the
    super-blocks' scaled sums (2^-20 of the sum of |x| |w|)."""
    step = x.double().reshape(x.shape[0], -1, 256).abs().amax(-1) / 254        # [M, S]
    per_super = w.double().abs().reshape(w.shape[0], -1, 256).sum(-1)          # [N, S]
    return step @ per_super.T + 2.0 ** -20 * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("m", [1, 3, 9, 40])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_the_reference_and_dequantize_then_matmul(each_build, qtype, m, n, k, poisoned_empty):
    raw, weight = _quantized(qtype, n, k, m * 1000 + n + k)
    gen = torch.Generator().manual_seed(m + n + k)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    x[0, k - 256:] = 0.0                                   # a super-block of x of scale 0
    got = quant_linear.matmul(x, weight, bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.equal(got, quant_linear.reference_matmul(x, weight, bias))   # the same sequence, bit for bit
    w = torch.from_numpy(dequantize(raw, qtype))
    exact = x.double() @ w.double().T + bias.double()
    assert ((got.double() - exact).abs() <= _activation_bound(x, w) + 1e-4).all()
    got16 = quant_linear.matmul(x.to(torch.bfloat16), weight, bias)
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16, quant_linear.reference_matmul(x.to(torch.bfloat16), weight, bias))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_row_count_to_16_matches_the_reference(each_build, qtype):
    """1 to 16 rows: every split into the kernels' row tiles (K-quants: up to 6 on AVX-512, 4 on AVX2), bit for bit."""
    raw, weight = _quantized(qtype, 45, 512, 7)
    gen = torch.Generator().manual_seed(int(qtype))
    for m in range(1, 17):
        x = torch.randn(m, 512, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        x.view(-1)[::97] *= 50.0                       # outliers: most values round to small integers
        assert torch.equal(quant_linear.matmul(x, weight), quant_linear.reference_matmul(x, weight)), m


def _extreme_rows(qtype) -> np.ndarray:
    """File rows of two super-blocks at the integer sums' limits, d and dmin 1.0: Q4_K and Q5_K all bits set (every
    value 15 or 31, every scale and min 63); Q6_K's values 63 or 0 (-32 less its offset) with scales -128 or 127;
    IQ4_XS's levels -127 or 113 (241 as VNNI multiplies them) with scales -32, 31 or both in turn."""
    size, one = kquant.BLOCK_BYTES[qtype], np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if qtype == Q.IQ4_XS:
        rows = np.zeros((16, 2, size), np.uint8)
        for r in range(16):
            rows[r, :, 0:2] = one
            high, low = ((0x00, 0x00), (0xFF, 0xFF), (0xCC, 0xF0), (0x33, 0x0F))[r // 2 % 4]   # sc -32, 31, mixed
            rows[r, :, 2:4], rows[r, :, 4:8] = high, low
            rows[r, :, 8:] = 0xFF if r % 2 else 0
        return rows.reshape(16, -1)
    if qtype != Q.Q6_K:
        rows = np.full((16, 2, size), 0xFF, np.uint8)
        rows[..., 0:2] = rows[..., 2:4] = one
        rows[1::2, :, 2:4] = 0                         # and without the minimums
        return rows.reshape(16, -1)
    rows = np.zeros((16, 2, size), np.uint8)
    for r in range(16):
        rows[r, :, :192] = 0xFF if r % 2 else 0
        rows[r, :, 192:208] = (0x80, 0x7F, 0x80, 0x01)[r // 2 % 4]
        rows[r, :, 208:210] = one
    return rows.reshape(16, -1)


@pytest.mark.parametrize("rows", [4, 40])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_integer_sums_at_their_limits_stay_exact(each_build, qtype, rows):
    """Every x at +-amax (127 quantized) against the largest values and scales: a super-block's int32 sum reaches
    Q5_K's 256 * 31 * 127 * 63 (2^26) and Q6_K's unsigned part 256 * 63 * 127 * 128 (2^28); nothing wraps, and
    the sums' rounding to float32 is the reference's. At 40 rows AVX2 puts the tokens in the lanes, whose int16
    pair sums run to 8 x 2 * 15 * 127 (Q4_K), 4 x 2 * 31 * 127 (Q5_K) and 2 x 2 * 63 * 127 (Q6_K)."""
    raw = _extreme_rows(qtype)
    w = torch.from_numpy(dequantize(raw, qtype))
    assert w.abs().max() >= {Q.Q5_K: 31 * 63, Q.Q4_K: 15 * 63, Q.Q6_K: 32 * 128, Q.IQ4_XS: 127 * 32}[qtype]
    weight = quant_linear.pack(QuantTensor(int(qtype), torch.from_numpy(raw), 512))
    signs = torch.ones(4, 512)
    signs[1] = -1.0
    signs[2, 32:64] = signs[2, 256 + 16:256 + 48] = -1.0            # a sub-block of each sign
    signs[3, 1::2] = -1.0
    signs = signs.repeat(rows // 4, 1)
    got = quant_linear.matmul(signs, weight)
    assert torch.equal(got, quant_linear.reference_matmul(signs, weight))
    exact = signs.double() @ w.double().T                             # x quantizes exactly: 127 * (1 / 127)
    assert torch.allclose(got.double(), exact, rtol=2.0 ** -20, atol=0)


@pytest.mark.parametrize("v_type", [Q.Q6_K, Q.Q5_0, Q.Q5_1], ids=lambda t: t.name)
def test_types_fused_by_rows_multiply_as_one_weight(each_build, v_type):
    """A K-quant mix's q and k in Q4_K, v in Q6_K (or Q5_0 / Q5_1, as llama.cpp stores tensors whose rows
    are not whole super-blocks): one stacked weight of packed parts, its rows in order."""
    parts = [_quantized(qtype, n, 512, n)[1] for qtype, n in ((Q.Q4_K, 40), (Q.Q4_K, 24), (v_type, 24))]
    fused = QuantTensor.cat([QuantTensor(int(Q.Q4_K), quant_linear.unpack(p), 512) for p in parts[:2]])
    stacked = quant_linear.stack([quant_linear.pack(fused), parts[2]])
    assert isinstance(stacked, QuantStack) and stacked.shape == (88, 512)
    assert [p.name for p in stacked.parts] == ["Q4_K", v_type.name]
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



@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_in_c_are_dequantize_s_bits(qtype, dtype, monkeypatch):
    """As the 32-value types', past the first super-block (kquant_row in quant_gemm.c)."""
    raw, _ = _quantized(qtype, 45, 768, 11)
    assert_embedding_rows_in_c(raw, qtype, 768, dtype, monkeypatch)
