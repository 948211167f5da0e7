"""bf16 rows times a GGUF-quantized weight on AMX (quant_amx.c / quant_amx.py): the product against x times
the weight dequantized and rounded to bf16, in float64, within the float32 sums and the output's rounding;
exact where every partial sum is; the AVX2 build's refusal; and the per-shape choice of when to use it.
The kernel tests skip on a CPU without AMX; the dispatch and choice tests run everywhere."""

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

from kernels import cpu_native, get_ops, quant_amx, quant_linear
from kernels.quant_linear import QuantTensor
from tests import kquants
from tests.kernels.test_kquant_linear import SHAPES as K_SHAPES, TYPES as ALL_K_TYPES
from tests.kernels.test_quant_linear import HAS_TOOLCHAIN, SHAPES, TYPES as ALL_TYPES, _q8_0

# The types quant_amx.c widens: every type quant_gemm.c reads.
TYPES, K_TYPES = [t for t in ALL_TYPES if t in quant_amx.TYPES], [t for t in ALL_K_TYPES if t in quant_amx.TYPES]
IQ4 = [GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS]

pytestmark = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no AVX2 CPU or no C compiler")
needs_amx = pytest.mark.skipif(not (HAS_TOOLCHAIN and quant_amx.available()), reason="no AMX on this CPU")


def _weight(qtype, n, k, seed):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0, :32] = 0.0                                   # a block of scale 0
    w[-1, -32:] *= 1000.0                             # a block far from the others
    raw = kquants.quantize(w, qtype)
    return quant_linear.pack(QuantTensor(int(qtype), torch.from_numpy(raw), k), torch.bfloat16)


# every type on the shapes it takes: K-quants in whole super-blocks of 256
CASES = [(t, n, k) for t in TYPES for n, k in SHAPES + [(33, 1536)]] + [(t, n, k) for t in K_TYPES for n, k in K_SHAPES]


@needs_amx
# up to 48 rows the few-row path (in place, or copied where x is not whole tiles); partial tiles, an odd count
@pytest.mark.parametrize("m", [1, 16, 17, 32, 45, 48, 70])
@pytest.mark.parametrize("qtype,n,k", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_the_product_is_x_times_the_weight_rounded_to_bf16(qtype, m, n, k, poisoned_empty):
    weight = _weight(qtype, n, k, m * 1000 + n + k)
    gen = torch.Generator().manual_seed(m + n)
    x, bias = torch.randn(m, k, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen)
    got = quant_amx.matmul(x, weight, bias)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    _assert_within_rounding(got, x, weight, bias)
    # and the same product the int8 kernel approximates from the other side
    w = quant_linear.dequantize(weight).to(torch.bfloat16).double()
    int8 = quant_linear.matmul(x, weight, bias).double()
    assert ((got.double() - int8).abs() <= 0.05 * (x.double().abs() @ w.abs().T) + 1e-3).all()


def _assert_within_rounding(got, x, weight, bias):
    """got is x @ dequantize(weight).bfloat16().T + bias but for float32 sums and one rounding to bf16."""
    w = quant_linear.dequantize(weight).to(torch.bfloat16).double()
    exact = x.double() @ w.T + bias.double()
    # float32 sums of k products (relative 2^-24 each step), then one rounding to bf16 (half a step: 2^-9)
    sums = (x.double().abs() @ w.abs().T) * x.shape[1] * 2.0 ** -24
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + sums + 1e-30).all()


@needs_amx
@pytest.mark.parametrize("qtype,n,k", [(t, n, k) for t in TYPES for n, k in [(17, 64), (200, 96)]]
                         + [(t, n, k) for t in K_TYPES for n, k in [(17, 256), (200, 512)]],
                         ids=lambda v: getattr(v, "name", str(v)))   # a group past the last; several pairs a thread
def test_the_weight_is_widened_to_exactly_its_bf16_dequantization(qtype, n, k):
    """x's rows one-hot: row j picks column j of every weight row, one product in the float32 sums, so the
    output is the widened weight itself, bit for bit (but for the sign of a zero: a sum of zeros is +0)."""
    weight = _weight(qtype, n, k, 7)
    w = quant_linear.dequantize(weight).to(torch.bfloat16)
    got = quant_amx.matmul(torch.eye(k, dtype=torch.bfloat16), weight)
    assert torch.equal(got.T.float(), w.float())   # == on every value: -0 equals +0, a bf16 step does not


@needs_amx
def test_rows_past_one_part_come_out_as_each_part_alone():
    """x larger than the kernel takes at once (1 MB: 320 rows of 1536) goes in parts; a row's output does
    not depend on which part it is in."""
    weight = _weight(GGMLQuantizationType.Q4_1, 33, 1536, 3)
    x = torch.randn(700, 1536, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = quant_amx.matmul(x, weight)
    assert torch.equal(whole, torch.cat([quant_amx.matmul(x[r:r + 100], weight) for r in range(0, 700, 100)]))


def _tall_product(qtype, n, k, m, chunk, seed):
    """m rows of x times an n x k weight with a bias, in one call: within the rounding of the exact product, and
    bit for bit the rows computed `chunk` at a time. Returns the weight, x, the bias and the product."""
    weight = _weight(qtype, n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    x, bias = torch.randn(m, k, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen)
    whole = quant_amx.matmul(x, weight, bias)
    _assert_within_rounding(whole, x, weight, bias)
    assert torch.equal(whole, torch.cat([quant_amx.matmul(x[r:r + chunk], weight, bias) for r in range(0, m, chunk)]))
    return weight, x, bias, whole


@needs_amx
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                                   GGMLQuantizationType.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [232, 2072])   # 2072: 65 pairs of groups, so a thread copies x's tiles
def test_a_rows_output_does_not_depend_on_where_it_lies(qtype, n):
    """Tall x across parts, rows not a multiple of the tiles, groups not a multiple of the pairs (232 rows: 15
    groups, the last half full), with a bias: every row comes out as it does alone, in a chunk of 45, and on one
    thread, bit for bit; so no tile, part, thread's share, copy of x or block emitted during the next one's
    products mixes rows or columns."""
    weight, x, bias, whole = _tall_product(qtype, n, 1536, 1001, 45, 11)
    for r in (0, 15, 16, 31, 32, 333, 640, 1000):
        assert torch.equal(whole[r:r + 1], quant_amx.matmul(x[r:r + 1], weight, bias))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(whole, quant_amx.matmul(x, weight, bias))
    finally:
        torch.set_num_threads(threads)


@needs_amx
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [40, 232, 2072])   # 40: every chunk widened once, kept for the parts; 2072: a copy of x
def test_k_in_chunks_sums_as_k_whole(qtype, n):
    """K past one chunk (4352: 136 blocks, chunks of 64, 64 and 8): every pair's sums go through the chunks, kept
    in float32 between them, with several parts of x and a tail of rows; every row comes out as in the few-row
    path (K whole, no chunks), bit for bit, and within the rounding of the exact product."""
    _tall_product(qtype, n, 4352, 600, 40, 17)


@needs_amx
@pytest.mark.parametrize("n", [40, 232, 2072])   # one pair of groups, a few a thread, a copy of x's tiles anyway
def test_x_off_the_cache_lines_comes_out_the_same(n):
    """x 16 bytes past a cache line (as a scratch from malloc lies), tall enough for parts: every bit as the same
    rows aligned."""
    weight = _weight(GGMLQuantizationType.Q4_1, n, 1536, 13)
    x = torch.randn(700, 1536, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    flat = torch.empty(700 * 1536 + 32, dtype=torch.bfloat16)
    skew = (16 - flat.data_ptr() % 64) % 64 // 2   # values to the first address 16 bytes past a line
    off = flat[skew:skew + 700 * 1536].view(700, 1536)
    off.copy_(x)
    assert off.data_ptr() % 64 == 16
    assert torch.equal(quant_amx.matmul(off, weight), quant_amx.matmul(x, weight))


@needs_amx
def test_exact_integer_products_come_out_exact():
    """Q8_0 with scale 1 and small integer x: every product and sum is an integer below 256, which bf16
    holds exactly; 50 rows and 40 columns leave partial tiles of x and of the weight's groups."""
    rng = np.random.default_rng(0)
    m, n, k = 50, 40, 96
    w = rng.integers(-3, 4, size=(n, k))
    x = torch.from_numpy(rng.integers(-1, 2, size=(m, k))).float()
    expect = x @ torch.from_numpy(w).float().T
    assert expect.abs().max() < 256
    got = quant_amx.matmul(x.to(torch.bfloat16), _q8_0(w))
    assert torch.equal(got.float(), expect)


def test_a_build_without_amx_refuses(avx2_library):
    weight = _weight(GGMLQuantizationType.Q4_1, 40, 64, 1)
    x = torch.randn(64, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="no AMX"):
        quant_amx.matmul(x, weight, lib=avx2_library)


def test_the_cpu_ops_use_amx_from_the_measured_rows_only(monkeypatch):
    weight = _weight(GGMLQuantizationType.Q4_1, 40, 64, 1)
    calls = []
    monkeypatch.setattr(quant_amx, "matmul", lambda x, w, bias=None: calls.append(x.shape[0])
                        or quant_linear.matmul(x, w, bias))
    linear = get_ops("cpu").linear
    x = torch.randn(64, 64).to(torch.bfloat16)
    weight.amx_from = None
    linear(x, weight)
    weight.amx_from = 32
    for rows in (1, 31, 32, 64):
        assert linear(x[:rows], weight).shape == (rows, 40)
    linear(x[:40].float(), weight)                  # float32 rows stay with the int8 kernel
    assert calls == [32, 64]
    stack = quant_linear.QuantStack([weight, _weight(GGMLQuantizationType.Q8_0, 24, 64, 2)])
    stack.parts[1].amx_from = None
    assert linear(x, stack).shape == (64, 64) and calls == [32, 64, 64]   # each part by its own choice


def test_the_threshold_is_where_amx_wins_from_then_on():
    def ms(wins):
        out = {}
        for rows, win in zip(quant_amx.ROWS, wins):
            out[f"int8_{rows}"], out[f"amx_{rows}"] = 1.0, 0.5 if win else 2.0   # a win or a loss, no tie
        return out
    n = len(quant_amx.ROWS)
    assert quant_amx.ROWS[-3:] == (128, 256, 512)
    assert quant_amx.threshold(ms([False] * (n - 4) + [True] * 4)) == quant_amx.ROWS[-4]
    assert quant_amx.threshold(ms([True] * (n - 3) + [False, True, True])) == 256   # wins only from 256 on
    assert quant_amx.threshold(ms([True] * n)) == quant_amx.ROWS[0]
    assert quant_amx.threshold(ms([True] * (n - 1) + [False])) is None
    # within the margin at the largest count: AMX keeps the range where it is not the slower, never where it is
    assert quant_amx.threshold(ms([True] * n) | {"amx_512": 0.95}) == quant_amx.ROWS[0]
    assert quant_amx.threshold(ms([True] * n) | {"amx_512": 1.05}) is None
    assert quant_amx.threshold(ms([True] * n) | {"amx_512": 0.95}, ties=False) is None
    assert quant_amx.threshold(ms([True] * (n - 2) + [False, True]) | {"amx_256": 0.95}) == quant_amx.ROWS[0]
    assert quant_amx.threshold(ms([False] + [True] * (n - 1)) | {"amx_512": 1.0}) == quant_amx.ROWS[1]


def test_prepare_measures_bf16_weights_where_there_is_amx():
    raw = quantize(np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32),
                   GGMLQuantizationType.Q4_1)
    tensor = QuantTensor(int(GGMLQuantizationType.Q4_1), torch.from_numpy(raw), 64)
    assert quant_amx.prepare(tensor, torch.float32).amx_from is None
    bf16 = quant_amx.prepare(tensor, torch.bfloat16)
    if not quant_amx.available():
        assert bf16.amx_from is None
    else:
        assert bf16.amx_from == quant_amx.from_rows(bf16.qtype, 48, 64)   # measured once, then remembered
        assert bf16.amx_from in quant_amx.ROWS + (None,)


@pytest.mark.parametrize("qtype", IQ4, ids=lambda t: t.name)
def test_the_iq4_types_take_the_tiles_from_the_measured_rows(qtype, monkeypatch):
    """IQ4's levels are widened too: where AMX is the path and wins from 16 rows, an IQ4 weight takes the tiles
    from there and quant_gemm.c below; a type outside TYPES is refused by both launchers (the C side: -2)."""
    assert set(IQ4) <= set(quant_amx.TYPES)
    monkeypatch.setattr(quant_amx, "matmul_path", lambda dtype: ("amx", "tested"))
    monkeypatch.setattr(quant_amx, "from_rows", lambda qtype, n, k: 16)
    tensor = QuantTensor(int(qtype), torch.from_numpy(kquants.quantize(np.ones((32, 256), np.float32), qtype)), 256)
    weight = quant_amx.prepare(tensor, torch.bfloat16)
    assert weight.amx_from == 16
    few = torch.randn(8, 256).to(torch.bfloat16)
    assert torch.equal(quant_amx.linear(few, weight), quant_linear.matmul(few, weight))
    x = torch.randn(64, 256).to(torch.bfloat16)
    if quant_amx.available():
        assert torch.equal(quant_amx.linear(x, weight), quant_amx.matmul(x, weight))
        out = torch.empty(64, 32, dtype=torch.bfloat16)
        assert cpu_native.library().matinee_quant_amx(x.data_ptr(), 99, weight.packed.data_ptr(), None,
                                                      out.data_ptr(), 64, 32, 256, 1) == -2
    monkeypatch.setattr(quant_amx, "TYPES", ())
    with pytest.raises(ValueError, match="does not read"):
        quant_amx.matmul(x, weight)


def test_bad_input_is_refused():
    weight = _weight(GGMLQuantizationType.Q8_0, 20, 64, 5)
    with pytest.raises(ValueError, match="bf16 rows"):
        quant_amx.matmul(torch.randn(4, 64), weight)
    with pytest.raises(ValueError, match="shapes"):
        quant_amx.matmul(torch.randn(4, 32).to(torch.bfloat16), weight)
    q2_k = quant_linear.QuantWeight(torch.zeros(1, 1, 16 * 84, dtype=torch.uint8), int(GGMLQuantizationType.Q2_K),
                                    16, 256, torch.bfloat16)   # a type no kernel here reads
    with pytest.raises(ValueError, match="does not read"):
        quant_amx.matmul(torch.randn(4, 256).to(torch.bfloat16), q2_k)
