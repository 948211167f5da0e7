"""int8_rows.c's per-token quantization against quantize.quantize_activations, bit for bit, and the AVX2
build's refusal (torch's quantization then serves)."""

import pytest
import torch

from kernels import cpu_native, quant_linear_cpu
from kernels.quantize import quantize_activations
from tests.kernels.test_quant_linear import HAS_TOOLCHAIN

pytestmark = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no AVX2 CPU or no C compiler")


def _rows(m, k, dtype):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)) * 3
    x[0] = 0.0                                      # the scale's floor of 1e-12
    if m > 2:
        x[1] = torch.arange(k) % 254 - 126.5        # scale 1: every quotient a tie, rounded half to even
        x[1, 0] = 127.0
        x[2] *= 1e-30                               # tiny scales
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 1), (3, 15), (17, 100), (64, 2048), (5, 8193)])   # K off 16
def test_rows_are_quantized_as_torch_does(m, k, dtype):
    lib = cpu_native.library()
    if lib is None or lib.matinee_quantize_rows(0, 0, 0, 0, 0, 0, 1) != 0:
        pytest.skip("no AVX-512 here: torch quantizes")
    x = _rows(m, k, dtype)
    xq, scale = torch.full((m, k), 99, dtype=torch.int8), torch.full((m,), float("nan"))
    assert lib.matinee_quantize_rows(x.data_ptr(), int(dtype == torch.bfloat16), xq.data_ptr(), scale.data_ptr(),
                                     m, k, 2) == 0
    want_q, want_scale = quantize_activations(x)
    assert torch.equal(xq, want_q) and torch.equal(scale, want_scale)
    got_q, got_scale = quant_linear_cpu.quantized_rows(x.t().contiguous().t(), lib)   # not contiguous: copied first
    assert torch.equal(got_q, want_q) and torch.equal(got_scale, want_scale)


def test_a_build_without_avx512_leaves_it_to_torch(avx2_library):
    x = _rows(4, 64, torch.bfloat16)
    assert avx2_library.matinee_quantize_rows(x.data_ptr(), 1, 0, 0, 4, 64, 1) == -2
    got, want = quant_linear_cpu.quantized_rows(x, avx2_library), quantize_activations(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert quant_linear_cpu.quantized_rows(x.half(), cpu_native.library())[0].equal(quantize_activations(x.half())[0])
