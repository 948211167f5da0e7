"""bf16 rows times a packed bf16 weight (packed_linear.py's layout) on AMX's tiles (quant_amx.c's BF16P): the
product against float64 within the float32 sums and the output's rounding, the weight read exactly, rows
independent of their neighbours; when the CPU backend sends rows there; and the per-shape choice. The
kernel tests skip on a CPU without AMX; the dispatch and choice tests run everywhere."""

import json

import pytest
import torch

from kernels import cpu_native, get_ops, packed_linear, quant_amx
from tests.kernels.test_packed_linear import HAS_TOOLCHAIN

pytestmark = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no AVX2 CPU or no C compiler")
needs_amx = pytest.mark.skipif(not (HAS_TOOLCHAIN and quant_amx.available()), reason="no AMX on this CPU")


def _product(x, packed, bias=None):
    return quant_amx.product(x, packed, quant_amx.BF16P, bias)


@needs_amx
@pytest.mark.parametrize("m", [1, 16, 17, 32, 45, 48, 70])
@pytest.mark.parametrize("n,k", [(1, 32), (17, 64), (33, 96), (100, 352), (40, 1536)])   # N off the 32-column blocks
def test_the_product_is_x_times_the_weight(m, n, k):
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    w, x = (torch.randn(r, k, generator=gen).to(torch.bfloat16) for r in (n, m))
    bias = torch.randn(n, generator=gen)
    got = _product(x, packed_linear.pack(w), bias)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    exact = x.double() @ w.double().T + bias.double()
    sums = (x.double().abs() @ w.double().abs().T) * k * 2.0 ** -24   # float32 sums, then one rounding to bf16
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + sums + 1e-30).all()


@needs_amx
@pytest.mark.parametrize("n,k", [(17, 64), (200, 96)])
def test_the_weight_is_read_exactly(n, k):
    """One-hot rows of x pick single weights: the output is the weight, transposed, bit for bit."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    got = _product(torch.eye(k, dtype=torch.bfloat16), packed_linear.pack(w))
    assert torch.equal(got.T.float(), w.float())


@needs_amx
def test_a_rows_output_does_not_depend_on_where_it_lies():
    """Tall x across the kernel's parts and threads, rows not a multiple of the tiles: every row as alone."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(232, 1536, generator=gen).to(torch.bfloat16), torch.randn(1001, 1536, generator=gen).to(torch.bfloat16)
    packed = packed_linear.pack(w)
    whole = _product(x, packed)
    assert torch.equal(whole, torch.cat([_product(x[r:r + 45], packed) for r in range(0, 1001, 45)]))
    for r in (0, 15, 16, 333, 1000):
        assert torch.equal(whole[r:r + 1], _product(x[r:r + 1], packed))


def test_bad_input_is_refused():
    packed = packed_linear.pack(torch.randn(8, 48).to(torch.bfloat16))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        _product(torch.randn(2, 48).to(torch.bfloat16), packed)
    with pytest.raises(ValueError, match="bf16 rows"):
        _product(torch.randn(2, 64), packed_linear.pack(torch.randn(8, 64).to(torch.bfloat16)))
    assert packed_linear.amx_rows(8, 48, False) == (None, None)   # never chosen for such a shape


def test_the_cpu_ops_use_amx_from_the_measured_rows_only(monkeypatch):
    calls = []
    monkeypatch.setattr(quant_amx, "product", lambda x, w, qtype, bias=None: calls.append(x.shape[0])
                        or packed_linear.matmul(x, w, bias))
    monkeypatch.setattr(packed_linear, "layout", lambda n, k: ("both", False))
    w = torch.randn(40, 64).to(torch.bfloat16)
    x = torch.randn(packed_linear.TORCH_FROM_ROWS, 64).to(torch.bfloat16)
    ops = get_ops("cpu", "cpu")
    monkeypatch.setattr(packed_linear, "amx_rows", lambda n, k, dot: (32, None))
    weight = ops.prepare_weight(w)
    assert weight.amx_from == 32 and weight.plain is None   # torch never beat AMX: no plain copy kept
    for rows in (1, 31, 32, 64):
        assert ops.linear(x[:rows], weight).shape == (rows, 40)
    ops.linear(x[:40].float(), weight)   # float32 rows stay with the packed kernel
    assert calls == [32, 64]
    monkeypatch.setattr(packed_linear, "amx_rows", lambda n, k, dot: (16, 48))
    weight = ops.prepare_weight(w)
    assert weight.plain is w and weight.torch_from == 48   # torch wins from 48 rows: AMX between 16 and 48
    ops.linear(x[:20], weight), ops.linear(x[:47], weight)
    assert torch.equal(ops.linear(x[:48], weight), torch.nn.functional.linear(x[:48], w))
    assert calls == [32, 64, 20, 47]
    monkeypatch.setattr(packed_linear, "amx_rows", lambda n, k, dot: (None, None))
    weight = ops.prepare_weight(w)
    assert weight.plain is w and weight.torch_from == packed_linear.TORCH_FROM_ROWS   # no AMX: as before


def test_the_amx_choice_is_measured_once_and_kept(monkeypatch):
    if not quant_amx.available():
        assert packed_linear.amx_rows(64, 64, False) == (None, None)
        return
    monkeypatch.setattr(cpu_native, "BUSY_SHARE", 1.0)   # kept however busy the machine
    monkeypatch.setattr(packed_linear, "_amx_decisions", {})
    threads, rows = torch.get_num_threads(), ",".join(map(str, packed_linear.AMX_ROWS))
    packed_linear.amx_rows(40, 64, False)
    path = cpu_native.library().path.with_suffix(".bf16-amx.json")
    known = json.loads(path.read_text())
    assert set(known[f"{threads} threads 40x64 dot 0 rows {rows} torch"]) == \
        {f"{name}_{r}" for name in ("amx", "kernel", "torch") for r in packed_linear.AMX_ROWS}

    def timings(amx_wins_from: int, torch_wins_from: int) -> dict:
        rows_ = packed_linear.AMX_ROWS
        return ({f"kernel_{r}": 1.0 for r in rows_} | {f"amx_{r}": 0.5 if r >= amx_wins_from else 1.0 for r in rows_}
                | {f"torch_{r}": 0.2 if r >= torch_wins_from else 1.0 for r in rows_})
    known[f"{threads} threads 8x64 dot 0 rows {rows} torch"] = timings(32, 1000)
    known[f"{threads} threads 16x64 dot 0 rows {rows} torch"] = timings(32, 128)   # torch far faster from 128
    known[f"{threads} threads 24x64 dot 1 rows {rows} torch"] = timings(1000, 16)  # AMX never wins
    known[f"{threads} threads 32x64 dot 0 rows {rows} torch"] = timings(64, 16)    # torch only where AMX is taken
    path.write_text(json.dumps(known))
    assert packed_linear.amx_rows(8, 64, False) == (32, None)
    assert packed_linear.amx_rows(16, 64, False) == (32, 128)
    assert packed_linear.amx_rows(24, 64, True) == (None, None)
    assert packed_linear.amx_rows(32, 64, False) == (64, 64)
