"""torch's CPU int8 (_int_mm) and int4 (_weight_int4pack_mm_for_cpu) paths against quant_matmul.py, and
int8_gemm.c against _int_mm's path.

Weights have std K^-1/2, so outputs are of order 1 and tolerances are absolute. int8 against
the same math in float32 (x quantized per token too): 1e-5, the int32 sums being exact. int4
against dequantize-then-matmul: float32 1e-5; float16 3e-3 (scales and the output rounded to
float16); bfloat16 3e-2 (torch keeps the group scales in bfloat16, 2^-9 relative). The bias (std 1)
can carry an output to several units, where rounding the output and the scales to float16 or
bfloat16 costs up to a unit in the last place of the output: that part of the bound is relative.
"""

from dataclasses import replace

import pytest
import torch

from kernels import cpu_native, quant_linear_cpu, quant_matmul
from kernels.quantize import quantize_activations, quantize_int4, quantize_int8

INT4_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
INT4_RTOL = {torch.float32: 0.0, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}   # one ulp of the output


def _weight(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5


def _x(m, k, dtype=torch.float32, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("m", [1, 3, 17])
def test_int8_matches_the_same_math_in_float32(m):
    weight = quantize_int8(_weight(47, 100))
    bias = torch.randn(47, generator=torch.Generator().manual_seed(2))
    x = _x(m, 100)
    out = quant_linear_cpu.linear(x, weight, bias)
    torch.testing.assert_close(out, quant_matmul.int8_dynamic_linear(x, weight, bias), atol=1e-5, rtol=0)
    # Against float activations the per-token rounding costs under 2% of the output's norm.
    exact = quant_matmul.linear(x, weight, bias)
    assert (out - exact).norm() / exact.norm() < 0.02


def test_int8_keeps_bfloat16_activations_in_bfloat16():
    weight = quantize_int8(_weight(16, 64))
    x = _x(2, 64, torch.bfloat16)
    out = quant_linear_cpu.linear(x, weight)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, quant_matmul.int8_dynamic_linear(x, weight), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 5, 9, 300])
@pytest.mark.parametrize("n,k", [(1, 1), (47, 100), (131, 577), (64, 4096)])   # N off 4, K off 64, K past 512
def test_the_vnni_kernel_gives_int_mms_bits(n, k, m, dtype):
    """int8_gemm.c (where the CPU has AVX-512 VNNI) against torch._int_mm's path, bit for bit, with
    and without a bias, at one and two threads; past INT8_KERNEL_ROWS the two paths give the same bits
    too, so a row's result never depends on its batch."""
    lib = cpu_native.library()
    if lib is None or not lib.matinee_int8_vnni():
        pytest.skip("no AVX-512 VNNI here: torch._int_mm serves")
    plain = quantize_int8(_weight(n, k, seed=n + k))
    prepared = quant_linear_cpu.prepare_int8(plain)
    assert torch.equal(prepared.row_sums, plain.qweight.sum(dim=1, dtype=torch.int32)) and plain.row_sums is None
    x = _x(m, k, dtype, seed=m)
    x[0, : min(k, 7)] = 0.0   # a row's zeros and sums of either sign
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    xq, xs = quantize_activations(x)
    direct = torch.full((m, n), float("nan"), dtype=dtype)   # the kernel itself, not a fallback
    assert lib.matinee_int8_gemm(xq.data_ptr(), xs.data_ptr(), prepared.qweight.data_ptr(), prepared.row_sums.data_ptr(),
                                 prepared.scale.data_ptr(), None, direct.data_ptr(), int(dtype == torch.bfloat16),
                                 m, n, k, 2) == 0
    assert torch.equal(direct, quant_linear_cpu.linear(x, plain))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for b in (None, bias):
                got, want = quant_linear_cpu.linear(x, prepared, b), quant_linear_cpu.linear(x, plain, b)
                assert got.dtype == dtype and torch.equal(got, want)
                assert torch.equal(quant_linear_cpu.linear(x[:1], prepared, b), want[:1])
    finally:
        torch.set_num_threads(before)


def test_a_build_without_vnni_falls_back_to_int_mm(avx2_library):
    plain = quantize_int8(_weight(20, 64))
    prepared = replace(plain, row_sums=plain.qweight.sum(dim=1, dtype=torch.int32))
    x = _x(3, 64, torch.bfloat16)
    assert not avx2_library.matinee_int8_vnni()
    assert torch.equal(quant_linear_cpu.int8_linear(x, prepared, lib=avx2_library), quant_linear_cpu.linear(x, plain))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("group_size,symmetric", [(32, False), (64, True), (128, False)])
def test_int4_matches_dequantize_then_matmul(m, dtype, group_size, symmetric):
    # 47 outputs: not a multiple of the 16 torch's packing needs.
    weight = quantize_int4(_weight(47, 256), group_size, symmetric=symmetric)
    prepared = quant_linear_cpu.prepare_int4(weight, dtype)
    x, bias = _x(m, 256, dtype), torch.randn(47, generator=torch.Generator().manual_seed(2))
    out = quant_linear_cpu.linear(x, prepared, bias)
    assert out.dtype == dtype and out.shape == (m, 47)
    torch.testing.assert_close(out.float(), quant_matmul.linear(x.float(), weight, bias), atol=INT4_TOL[dtype],
                               rtol=INT4_RTOL[dtype])


def test_int4_errors_are_clear():
    prepared = quant_linear_cpu.prepare_int4(quantize_int4(_weight(16, 64), 32), torch.float32)
    with pytest.raises(ValueError, match="prepared for torch.float32"):
        quant_linear_cpu.linear(_x(1, 64, torch.bfloat16), prepared)
    with pytest.raises(ValueError, match="shapes do not match"):
        quant_linear_cpu.linear(_x(1, 32), prepared)
    with pytest.raises(ValueError, match="activations"):
        quant_linear_cpu.prepare_int4(quantize_int4(_weight(16, 64), 32), torch.int8)
    one_group = quantize_int4(_weight(16, 512), 128)
    one_group = type(one_group)(one_group.qweight, one_group.scale[:, :1].contiguous(), None, 512)
    with pytest.raises(ValueError, match="groups of"):
        quant_linear_cpu.prepare_int4(one_group, torch.float32)
