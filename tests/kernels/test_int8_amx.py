"""`--quantization int8` on AMX's int8 tiles (int8_amx.c / int8_amx.py): the kernel against torch._int_mm's
path bit for bit, a row's result independent of its batch and of the path its row count takes, the AVX2
build's refusal, the per-shape choice of when to use it, and int8_linear's dispatch. The kernel tests skip
on a CPU without AMX-INT8; the choice and dispatch tests run everywhere."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kernels import cpu_native, int8_amx, quant_amx, quant_linear_cpu
from kernels.quantize import Int8Weight, quantize_activations, quantize_int8
from tests.kernels.test_quant_linear import HAS_TOOLCHAIN

needs_amx = pytest.mark.skipif(not (HAS_TOOLCHAIN and int8_amx.available()), reason="no AMX-INT8 on this CPU")


def _weight(n, k, seed=0):
    return quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5)


def _x(m, k, dtype, seed=1):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[0, : min(k, 7)] = 0.0   # a row's zeros and sums of either sign
    return x


def _kernel(x, weight, bias, threads):
    """int8_amx.c itself (no fallback) into NaNs: an output it forgets cannot pass."""
    xq, xs = quantize_activations(x)
    out = torch.full((x.shape[0], weight.out_features), float("nan"), dtype=x.dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        status = int8_amx.launch(cpu_native.library(), xq, xs, weight, None if bias is None else bias.float(), out)
    finally:
        torch.set_num_threads(before)
    assert status == 0
    return out


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 16, 17, 45, 48, 70, 700])   # partial tiles, an odd count of tiles, parts of x
@pytest.mark.parametrize("n,k", [(47, 128), (33, 64), (131, 577), (40, 1000), (50, 4096)])   # N off 16 and 32,
# K off 64 (zero-padded), K past one chunk of 16 blocks (sums kept between chunks)
def test_the_kernel_gives_int_mms_bits(n, k, m, dtype):
    plain = _weight(n, k, seed=n + k)
    x, bias = _x(m, k, dtype, seed=m), torch.randn(n, generator=torch.Generator().manual_seed(3))
    for b in (None, bias):
        want = quant_linear_cpu.int8_linear(x, plain, b)   # no row sums, no amx_from: torch._int_mm's path
        for threads in (1, 2):
            assert torch.equal(_kernel(x, plain, b, threads), want)


@needs_amx
@pytest.mark.parametrize("n,k", [(47, 128), (131, 577), (50, 4096)])
def test_a_rows_result_does_not_depend_on_its_batch_or_path(n, k):
    """amx_from 32: rows 1-16 go to int8_gemm.c, 17-31 to torch._int_mm, 32 on to AMX; every row comes out
    as it does alone, whichever path its batch took."""
    weight = replace(quant_linear_cpu.prepare_int8(_weight(n, k), measure=False), amx_from=32)
    x = _x(300, k, torch.bfloat16)
    batch = quant_linear_cpu.int8_linear(x, weight)
    for rows in (1, 16, 24, 32, 45, 300):
        assert torch.equal(quant_linear_cpu.int8_linear(x[:rows], weight), batch[:rows])
    for row in (0, 17, 299):
        assert torch.equal(quant_linear_cpu.int8_linear(x[row:row + 1], replace(weight, amx_from=1)), batch[row:row + 1])
    assert torch.equal(_kernel(x.flip(0), weight, None, 2), batch.flip(0))   # neighbours changed


@needs_amx
def test_extreme_values_stay_exact():
    """Every byte at -127 or 127 (|sums| up to 127^2 K, exact in int32) and K off 64."""
    k = 4160 + 7
    q = torch.where(torch.rand(37, k, generator=torch.Generator().manual_seed(0)) < 0.5, -127, 127).to(torch.int8)
    weight = Int8Weight(q, torch.full((37,), 1 / 127))
    x = torch.where(torch.rand(40, k, generator=torch.Generator().manual_seed(1)) < 0.5, -1.0, 1.0)
    x[:, 0] = 127.0
    assert torch.equal(_kernel(x, weight, None, 2), quant_linear_cpu.int8_linear(x, weight))


def test_a_build_without_amx_refuses(avx2_library):
    weight = replace(_weight(20, 64), amx_from=1)
    x = _x(40, 64, torch.bfloat16)
    xq, xs = quantize_activations(x)
    assert int8_amx.launch(avx2_library, xq, xs, weight, None, torch.empty(40, 20)) == int8_amx.UNAVAILABLE
    assert not int8_amx.available(avx2_library)
    assert torch.equal(quant_linear_cpu.int8_linear(x, weight, lib=avx2_library),
                       quant_linear_cpu.int8_linear(x, replace(weight, amx_from=None)))   # torch._int_mm serves


def _ms(wins):
    out = {}
    for rows, win in zip(int8_amx.ROWS, wins):
        out[f"other_{rows}"], out[f"amx_{rows}"] = 1.0, 0.5 if win else 2.0   # a win or a loss, no tie
    return out


def test_the_threshold_is_where_amx_wins_from_then_on(monkeypatch):
    n = len(int8_amx.ROWS)
    assert int8_amx.ROWS[:5] == (4, 8, 16, 24, 32) and int8_amx.ROWS[-1] == 512
    choose = lambda ms: quant_amx.threshold(ms, int8_amx.OTHER, int8_amx.ROWS)   # noqa: E731
    assert choose(_ms([False, False] + [True] * (n - 2))) == 16
    assert choose(_ms([True] * (n - 3) + [False, True, True])) == 256
    assert choose(_ms([True] * n)) == 4
    assert choose(_ms([True] * (n - 1) + [False])) is None
    assert choose(_ms([True] * n) | {"amx_512": 0.95}) == 4   # within the margin, not the slower: a tie
    assert choose(_ms([True] * n) | {"amx_512": 1.05}) is None   # within the margin but the slower: not AMX's
    # from_rows: the kept timings' choice, measured once per shape and thread count
    asked = []
    monkeypatch.setattr(int8_amx, "_decisions", {})
    monkeypatch.setattr(cpu_native, "kept_measurement",
                        lambda suffix, name, measure: asked.append((suffix, name)) or _ms([False] + [True] * (n - 1)))
    linear = quant_linear_cpu.int8_linear
    assert int8_amx.from_rows(48, 64, linear) == 8 and int8_amx.from_rows(48, 64, linear) == 8
    name = f"{torch.get_num_threads()} threads int8 48x64 rows 4,8,16,24,32,64,128,256,512"
    assert asked == [(".int8-amx.json", name)]


def test_prepare_stores_the_measured_rows_where_there_is_amx(monkeypatch):
    plain = _weight(48, 64)
    prepared = quant_linear_cpu.prepare_int8(plain)
    assert prepared.amx_from == (int8_amx.from_rows(48, 64, quant_linear_cpu.int8_linear) if int8_amx.available() else None)
    assert prepared.amx_from in int8_amx.ROWS + (None,)
    assert quant_linear_cpu.prepare_int8(plain, measure=False).amx_from is None
    monkeypatch.setattr(int8_amx, "available", lambda lib=None: True)
    monkeypatch.setattr(int8_amx, "from_rows", lambda n, k, linear: 24 if (n, k) == (48, 64) else None)
    assert quant_linear_cpu.prepare_int8(plain).amx_from == 24
    monkeypatch.setattr(int8_amx, "available", lambda lib=None: False)
    assert quant_linear_cpu.prepare_int8(plain).amx_from is None


def test_int8_linear_picks_the_kernel_by_rows(monkeypatch):
    """AMX from amx_from rows on, int8_gemm.c up to INT8_KERNEL_ROWS below that, torch._int_mm otherwise; a
    kernel that refuses (status != 0) leaves the rows to the next."""
    calls, status = [], {"amx": 0, "vnni": 0}

    def fake(name, fill):
        def launch(lib, xq, xs, weight, bias, out):
            calls.append((name, xq.shape[0]))
            out.fill_(fill)
            return status[name]
        return launch

    monkeypatch.setattr(int8_amx, "launch", fake("amx", 7.0))
    monkeypatch.setattr(quant_linear_cpu, "_vnni", fake("vnni", 5.0))
    weight = replace(quant_linear_cpu.prepare_int8(_weight(20, 64), measure=False), amx_from=32)
    x, lib = _x(64, 64, torch.bfloat16), SimpleNamespace(matinee_quantize_rows=lambda *args: -2)   # torch quantizes
    served = {rows: quant_linear_cpu.int8_linear(x[:rows], weight, lib=lib)[0, 0].item() for rows in (1, 16, 17, 31, 32, 64)}
    assert calls == [("vnni", 1), ("vnni", 16), ("amx", 32), ("amx", 64)]
    assert served[1] == served[16] == 5.0 and served[32] == served[64] == 7.0 and served[17] not in (5.0, 7.0)
    calls.clear()
    quant_linear_cpu.int8_linear(x.half(), weight, lib=lib)                      # float16: torch alone
    quant_linear_cpu.int8_linear(x, replace(weight, amx_from=None), lib=lib)   # not measured: no AMX
    assert calls == []
    status["amx"] = int8_amx.UNAVAILABLE
    low = replace(weight, amx_from=8)
    assert quant_linear_cpu.int8_linear(x[:16], low, lib=lib)[0, 0].item() == 5.0
    assert quant_linear_cpu.int8_linear(x[:40], low, lib=lib)[0, 0].item() not in (5.0, 7.0)
    assert calls == [("amx", 16), ("vnni", 16), ("amx", 40)]
