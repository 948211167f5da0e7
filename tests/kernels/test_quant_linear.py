"""The GGUF-quantized CPU matmul (quant_gemm.c) and its layout: the packer against the gguf package's
dequantizer bit for bit, both builds (-march=native and AVX2) against the torch reference of the same
math, and both against dequantize-then-matmul in float32 within the bound of int8 activations."""

import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from kernels import cpu_native, get_ops, quant_linear
from kernels.quant_linear import QuantTensor
from tests.kquants import quantize

HAS_TOOLCHAIN = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("cc") is not None
pytestmark = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no AVX2 CPU or no C compiler")

TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
         GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.IQ4_NL]
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


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_in_c_are_dequantize_s_bits(qtype, dtype, monkeypatch):
    raw, _ = _quantized(qtype, 45, 96, 7)
    assert_embedding_rows_in_c(raw, qtype, 96, dtype, monkeypatch)


def assert_embedding_rows_in_c(raw: np.ndarray, qtype, k: int, dtype: torch.dtype, monkeypatch) -> None:
    """quant_gemm.c's row lookup of 45 file rows of k values gives `dequantize`'s rows (the torch path, as gguf
    dequantizes them) bit for bit, rounded once to bf16 for a bf16 model, from every lane of a group; ids out
    of range are refused before anything is read."""
    weight = quant_linear.pack(QuantTensor(int(qtype), torch.from_numpy(raw), k), dtype)
    rows = torch.tensor([[44, 0, 17], [16, 15, 44], [31, 32, 1]])
    got = quant_linear.embedding(rows, weight)
    assert got.dtype == dtype and got.shape == (3, 3, k)
    assert torch.equal(got, quant_linear.dequantize(weight, rows.reshape(-1)).to(dtype).view(3, 3, k))
    assert torch.equal(got, torch.from_numpy(dequantize(raw, qtype)[rows.reshape(-1).numpy()]).to(dtype).view(3, 3, k))
    monkeypatch.setattr(cpu_native, "library", lambda: None)   # the torch path agrees with itself
    assert torch.equal(got, quant_linear.embedding(rows, weight))
    monkeypatch.undo()
    for bad in ([45], [-1], [3, 45]):
        with pytest.raises(IndexError, match="out of range"):
            quant_linear.embedding(torch.tensor(bad), weight)


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
    with pytest.raises(ValueError, match="bytes"):
        quant_linear.pack(QuantTensor(int(GGMLQuantizationType.Q5_1), torch.from_numpy(raw), 64))   # Q8_0's bytes
    with pytest.raises(ValueError, match="type"):
        quant_linear.pack(QuantTensor(int(GGMLQuantizationType.Q2_K), torch.from_numpy(raw), 64))


def _q8_0(values: np.ndarray) -> quant_linear.QuantWeight:
    """A Q8_0 weight of int8 `values` [N, K] with every scale d 1.0: its products are exact integers."""
    n, k = values.shape
    blocks = np.empty((n, k // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    blocks[..., 2:] = values.astype(np.int8).reshape(n, k // 32, 32).view(np.uint8)
    raw = torch.from_numpy(blocks.reshape(n, -1))
    return quant_linear.pack(QuantTensor(int(GGMLQuantizationType.Q8_0), raw, k))


@pytest.mark.parametrize("rows", [3, 39])
@pytest.mark.parametrize("qtype", TYPES[1:5], ids=lambda t: t.name)
def test_largest_values_times_the_largest_x_stay_exact(lib, qtype, rows):
    """Every value at its largest (Q4 nibbles 15, Q5 values 31) times x of +-127 in every column: the
    largest products a block can hold. Without VNNI the kernel sums several maddubs pair vectors in
    int16 before widening them; one sum too many wraps around and the output is no longer the
    reference's (which is exact). At 39 rows AVX2 puts the tokens in the lanes, with the same int16 runs."""
    n, k = 17, 96
    head = 2 + (2 if qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1) else 0)
    q5 = qtype in (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1)
    blocks = np.full((n, k // 32, head + (4 if q5 else 0) + 16), 0xFF, dtype=np.uint8)   # nibbles 15, fifth bits 1
    blocks[..., :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    if head == 4:
        blocks[..., 2:4] = np.array([0.0], dtype=np.float16).view(np.uint8)
    weight = quant_linear.pack(QuantTensor(int(qtype), torch.from_numpy(blocks.reshape(n, -1)), k))
    x = torch.full((3, k), 127.0)
    x[1] = -127.0
    x[2, ::2] = -127.0                                          # pairs of opposite signs
    x = x.repeat(rows // 3, 1)
    got = quant_linear.matmul(x, weight, lib=lib)
    assert torch.equal(got, quant_linear.reference_matmul(x, weight))
    top = 31 if q5 else 15
    offset = {GGMLQuantizationType.Q4_0: 8, GGMLQuantizationType.Q5_0: 16}.get(qtype, 0)
    assert got[0, 0].item() == 127 * k * (top - offset)        # no scale rounding: d 1.0, integer sums


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _f32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


# Biases of the columns whose weight rows are zero, and the bf16 each must come out as (f32_to_bf16).
SPECIAL = [(float("nan"), 0x7FC0), (_f32(0xFFC00001), 0x7FC0),           # any NaN: 0x7fc0
           (float("inf"), 0x7F80), (float("-inf"), 0xFF80), (_f32(0x7F7FFFFF), 0x7F80),   # FLT_MAX rounds up to inf
           (2.0 ** -134, 0x0000), (3 * 2.0 ** -134, 0x0002), (5 * 2.0 ** -134, 0x0002),    # denormal ties
           (-3 * 2.0 ** -134, 0x8002), (_f32(0x007FFFFF), 0x0080),                         # kept, not flushed
           (1 + 2.0 ** -8, 0x3F80), (1 + 3 * 2.0 ** -8, 0x3F82)]                           # normal ties


def test_bf16_outputs_round_ties_to_even(lib):
    """Integer outputs in [256, 1024), a bf16 step of 2 or 4 apart, most of them exact ties (257 -> 256,
    259 -> 260, 514 -> 512, 518 -> 520): random data almost never gives a tie, so a rounding other than
    to nearest even would pass every other test. The last 12 columns take their bias as it is: NaN, inf,
    denormals. 11 rows and 44 columns leave partial tiles on both builds."""
    m, n, k = 11, 44, 64
    targets = np.concatenate([np.arange(257, 289, 2), np.arange(514, 578, 4)])   # 32 ties, before offsets
    w = np.zeros((n, k), dtype=np.int64)
    w[:32, 0], w[:32, 1], w[:32, 33] = targets // 127, targets % 127, 1
    x = torch.zeros(m, k)
    x[:, 0], x[:, 1] = 127.0, 1.0                               # block 0: 127 * w0 + w1, the target
    x[:, 32] = torch.tensor([127.0, -127.0]).repeat(6)[:m]      # block 1: scale 1 too, and 2 * row
    x[:, 33] = 2.0 * torch.arange(m)
    weight = _q8_0(w)
    exact = targets[None, :] + 2 * np.arange(m)[:, None]        # [m, 32]: ties where odd below 512, 2 mod 4 above
    bias = torch.zeros(n)
    bias[:32] = torch.tensor([1.0, -1.0, 3.0, 0.0]).repeat(8)
    bias[32:] = torch.tensor([b for b, _ in SPECIAL])
    for b in (None, bias):
        got = quant_linear.matmul(x.to(torch.bfloat16), weight, b, lib=lib)
        value = exact + (0 if b is None else b[:32].numpy().astype(np.int64))
        step = np.where(value < 512, 2, 4)
        expect = np.round(value / step) * step                  # numpy rounds halves to even, as bf16 must
        assert (exact % 2 == 1).sum() > 100 and (value % step != 0).sum() > 100   # ties, with and without bias
        assert np.array_equal(got[:, :32].float().numpy(), expect)
        specials = np.array([bits for _, bits in SPECIAL] if b is not None else [0] * 12, dtype=np.uint16)
        assert (_bits(got[:, 32:]) == specials).all()
        ref = quant_linear.reference_matmul(x.to(torch.bfloat16), weight, b)
        finite = ~torch.isnan(ref)
        assert torch.equal(torch.isnan(got), ~finite)           # torch's NaN bits are its own (0xffff)
        assert np.array_equal(_bits(got)[finite.numpy()], _bits(ref)[finite.numpy()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x_quantizes_halves_to_even(lib, dtype):
    """x of scale 1 (amax 127) with half-integer values times an identity weight: each output is its
    quantized x, a half rounded to even (2.5 -> 2, -3.5 -> -4)."""
    k = 64
    x = torch.arange(-31.5, 32.5, 1.0).repeat(3, 1)             # 64 halves, -31.5 .. 31.5
    x[1] *= 3.0                                                 # -94.5 .. 94.5
    x[2] = x[2].flip(0) * 4.0 + 0.5                             # halves again, 126.5 .. -125.5
    x[:, 31], x[:, 63] = 127.0, -127.0                          # every block's amax 127
    weight = _q8_0(np.eye(k, dtype=np.int64))
    got = quant_linear.matmul(x.to(dtype), weight, lib=lib)
    assert torch.equal(got.float(), torch.from_numpy(np.round(x.numpy())))
    assert torch.equal(got, quant_linear.reference_matmul(x.to(dtype), weight))
