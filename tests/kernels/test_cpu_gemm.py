"""The few-row CPU matmul kernel (cpu_gemm.c) against torch's x @ w.T, on odd shapes, and its build."""

import shutil

import pytest
import torch

from kernels import cpu_gemm, cpu_native, get_ops

HAS_TOOLCHAIN = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("cc") is not None


def test_kernels_build_where_the_machine_can_build_them():
    # On a machine with AVX2 and a C compiler the serving path must not silently fall back to torch.
    assert cpu_native.available() == HAS_TOOLCHAIN
    assert get_ops("auto", "cpu").backend == ("cpu" if HAS_TOOLCHAIN else "torch")


needs_kernel = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no AVX2 CPU or no C compiler")


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 5, 24])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 7), (4, 8), (7, 9), (37, 577), (960, 576)])
def test_matches_torch(m, n, k, each_build, poisoned_empty):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    expect = (x.double() @ w.double().T).float()
    got = cpu_gemm.matmul_nt(x, w)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_batch(each_build):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 579, generator=gen)
    w = torch.randn(53, 579, generator=gen)
    whole = cpu_gemm.matmul_nt(x, w)
    for i in range(11):
        assert torch.equal(cpu_gemm.matmul_nt(x[i:i + 1], w)[0], whole[i])
    assert torch.equal(cpu_gemm.matmul_nt(x[3:8], w), whole[3:8])


@needs_kernel
def test_threads_give_the_same_bits():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 576, generator=gen)
    w = torch.randn(1000, 576, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.matmul_nt(x, w)
        torch.set_num_threads(2)
        two = cpu_gemm.matmul_nt(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_noncontiguous_input_and_model_linear_route():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(576, 4, generator=gen).t()          # a transposed view
    w = torch.randn(96, 576, generator=gen)
    bias = torch.randn(96, generator=gen)
    assert torch.equal(cpu_gemm.matmul_nt(x, w), cpu_gemm.matmul_nt(x.contiguous(), w))
    # The CPU backend's linear takes the kernel for a few float32 rows, torch beyond MAX_ROWS.
    linear = get_ops("cpu", "cpu").linear
    assert torch.equal(linear(x, w, bias), cpu_gemm.matmul_nt(x, w) + bias)
    big = torch.randn(cpu_gemm.MAX_ROWS + 1, 576, generator=gen)
    torch.testing.assert_close(linear(big, w), big @ w.T)
    half = linear(x.half(), w.half())
    assert half.dtype == torch.float16


@needs_kernel
def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.matmul_nt(torch.randn(2, 8, dtype=torch.float16), torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="shapes"):
        cpu_gemm.matmul_nt(torch.randn(2, 8), torch.randn(4, 9))


def test_build_is_cached_and_reports_a_missing_compiler(tmp_path, monkeypatch):
    if HAS_TOOLCHAIN:
        first = cpu_native.build(tmp_path)
        mtime = first.stat().st_mtime_ns
        assert cpu_native.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
        assert cpu_native.build(tmp_path, flags=cpu_native.AVX2) != first   # the flags name the library
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="C compiler"):
        cpu_native.build(tmp_path / "other")
