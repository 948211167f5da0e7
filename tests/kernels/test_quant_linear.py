"""The GGUF-quantized CPU matmul (quant_gemm.c) and its layout: the packer against the gguf package's
dequantizer bit for bit, both builds (-march=native and AVX2) against the torch reference of the same
math, and both against dequantize-then-matmul in float32 within the bound of int8 activations."""

import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels import cpu_native, get_ops, quant_linear
from kernels.quant_linear import QuantTensor

HAS_TOOLCHAIN = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("cc") is not None
pytestmark = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no AVX2 CPU or no C compiler")

TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]
SHAPES = [(1, 32), (17, 64), (45, 96), (100, 352)]   # (N, K): N off the 16-row groups, K odd blocks


@pytest.fixture(scope="module", params=["native", "avx2"])
def lib(request):
    """Each build of the kernels; the native one is the library the server loads."""
    if request.param == "native":
        lib = cpu_native.library()
        if torch.backends.cpu.get_cpu_capability() == "AVX512":
            assert lib.matinee_quant_width() == 512   # the AVX-512 path, not a silent AVX2 fallback
        return lib
    lib = request.getfixturevalue("avx2_library")
    assert lib.matinee_quant_width() == 256
    return lib


def _quantized(qtype, n, k, seed):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0, :32] = 0.0   # an all-zero block: scale 0
    raw = quantize(w, qtype)
    return raw, quant_linear.pack(QuantTensor(int(qtype), torch.from_numpy(raw), k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", SHAPES)
def test_packing_keeps_the_file_bytes_and_dequantizes_as_gguf_does(qtype, n, k):
    raw, weight = _quantized(qtype, n, k, n + k)
    assert weight.shape == (n, k) and weight.nbytes == -(-n // 16) * 16 * raw.shape[1]   # no float copy
    assert_unpacks_and_dequantizes_as_gguf(weight, raw, qtype)


def assert_unpacks_and_dequantizes_as_gguf(weight: QuantTensor, raw: np.ndarray, qtype) -> None:
    """The packed weight gives the file's bytes back, and dequantizes (whole, and as embedding rows) bit
    for bit as the gguf package does."""
    n = weight.shape[0]
    assert torch.equal(quant_linear.unpack(weight), torch.from_numpy(raw))
    expect = dequantize(raw, qtype)
    got = quant_linear.dequantize(weight).numpy()
    assert np.array_equal(got.view(np.uint32), expect.view(np.uint32))   # bit for bit
    rows = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert np.array_equal(quant_linear.embedding(rows, weight).numpy().view(np.uint32),
                          expect[rows.numpy()].view(np.uint32))


def _activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x_q @ w.T - x @ w.T| per output: each x is off by at most half its block's step (amax / 254)."""
    step = x.double().reshape(x.shape[0], -1, 32).abs().amax(-1) / 254        # [M, nb]
    per_block = w.double().abs().reshape(w.shape[0], -1, 32).sum(-1)          # [N, nb]
    return step @ per_block.T


@pytest.mark.parametrize("m", [1, 3, 9, 40])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_the_reference_and_dequantize_then_matmul(lib, qtype, m, n, k, poisoned_empty):
    raw, weight = _quantized(qtype, n, k, m * 1000 + n + k)
    gen = torch.Generator().manual_seed(m + n + k)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    got = quant_linear.matmul(x, weight, bias, lib=lib)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # The same integer dot products, scaled and added in the same order: bit for bit.
    ref = quant_linear.reference_matmul(x, weight, bias)
    assert torch.equal(got, ref)
    # Against float32 activations: within the error of quantizing x to int8 per block.
    w = torch.from_numpy(dequantize(raw, qtype))
    exact = x.double() @ w.double().T + bias.double()
    assert ((got.double() - exact).abs() <= _activation_bound(x, w) + 1e-4).all()
    # bf16 rows give bf16 outputs: the float32 result rounded once, as torch rounds.
    got16 = quant_linear.matmul(x.to(torch.bfloat16), weight, bias, lib=lib)
    ref16 = quant_linear.reference_matmul(x.to(torch.bfloat16), weight, bias)
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16, ref16)


def test_the_ops_dispatch_quantized_weights_on_both_backends():
    raw, weight = _quantized(GGMLQuantizationType.Q4_1, 40, 64, 1)
    x = torch.randn(3, 64)
    cpu, ref = get_ops("cpu"), get_ops("torch")
    assert torch.equal(cpu.linear(x, weight), ref.linear(x, weight))
    ids = torch.tensor([[3, 39], [0, 7]])
    assert torch.equal(cpu.embedding(ids, weight), ref.embedding(ids, weight))
    assert cpu.embedding(ids, weight).shape == (2, 2, 64)
    with pytest.raises(IndexError, match="out of range"):
        cpu.embedding(torch.tensor([40]), weight)


def test_bad_input_is_refused():
    raw, weight = _quantized(GGMLQuantizationType.Q8_0, 4, 64, 2)
    with pytest.raises(ValueError, match="shapes"):
        quant_linear.matmul(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="float16"):
        quant_linear.matmul(torch.randn(2, 64, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match="bytes"):
        quant_linear.pack(QuantTensor(int(GGMLQuantizationType.Q4_1), torch.from_numpy(raw), 64))
    with pytest.raises(ValueError, match="type"):
        quant_linear.pack(QuantTensor(int(GGMLQuantizationType.Q5_0), torch.from_numpy(raw), 64))
