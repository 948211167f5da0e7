"""The CPU layer ops (cpu_layer_ops.c: RMSNorm, rotary embedding, KV write, SiLU-and-multiply) against the torch references."""

import pytest
import torch

from kernels import activation, build_cos_sin_cache, cpu_layer_ops, cpu_native, kv_write, rms_norm, rope

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no AVX2 CPU or no C compiler")

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, expect: torch.Tensor) -> None:
    """float32: summation order only; bfloat16: at most one rounding step apart."""
    assert got.dtype == expect.dtype and got.shape == expect.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), expect.float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1), (3, 7), (1, 576), (65, 33), (130, 64)])
def test_rms_norm_matches_the_reference(dtype, rows, width, poisoned_empty):
    gen = torch.Generator().manual_seed(rows * 100 + width)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    weight = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    _close(cpu_layer_ops.rms_norm(x, weight, 1e-5), rms_norm.rms_norm(x, weight, 1e-5))
    out, new_residual = cpu_layer_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    expect, expect_residual = rms_norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, expect_residual)   # one addition, rounded once, either way
    _close(out, expect)


def test_bf16_rms_norm_keeps_denormals_and_nans():
    """Where the CPU rounds to bf16 in hardware (which flushes denormals), a denormal result still comes out
    as torch rounds it, and a NaN as a NaN."""
    x = torch.ones(3, 40, dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    weight = torch.full((40,), 1e-39, dtype=torch.bfloat16)   # a denormal bf16, times ~1
    got, expect = cpu_layer_ops.rms_norm(x, weight, 1e-6), rms_norm.rms_norm(x, weight, 1e-6)
    assert (expect[0] != 0).all() and expect[1].isnan().all() and got[1].isnan().all()
    assert torch.equal(got[::2].view(torch.int16), expect[::2].view(torch.int16))


def test_rms_norm_normalises_each_head_of_a_3d_tensor():
    x = torch.randn(4, 3, 16)
    weight = torch.rand(16) + 0.5
    _close(cpu_layer_ops.rms_norm(x, weight, 1e-6), rms_norm.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hk,head_dim", [(1, 9, 3, 64), (5, 4, 4, 2), (70, 8, 2, 34)])
def test_rope_on_slices_of_the_fused_qkv_matches_the_reference(dtype, tokens, hq, hk, head_dim):
    gen = torch.Generator().manual_seed(tokens + hq + head_dim)
    cache = build_cos_sin_cache(head_dim, 4096, 10000.0)
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split((hq * head_dim, hk * head_dim, hk * head_dim), dim=-1)
    q, k = q.reshape(tokens, hq, head_dim), k.reshape(tokens, hk, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    expect_q, expect_k = rope.rotary_embedding(positions, q.clone(), k.clone(), cache)
    got_q, got_k = cpu_layer_ops.rotary_embedding(positions, q, k, cache)
    assert got_q.data_ptr() == q.data_ptr()   # in place, in the step's own qkv buffer
    _close(got_q, expect_q)
    _close(got_k, expect_k)


def test_rope_refuses_a_position_outside_the_table():
    cache = build_cos_sin_cache(8, 16, 10000.0)
    q, k = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    with pytest.raises(IndexError):
        cpu_layer_ops.rotary_embedding(torch.tensor([3, 16]), q, k, cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [9, 100])   # 100: a prefill chunk's rows
def test_write_kv_matches_the_reference_and_skips_padding(dtype, tokens):
    gen = torch.Generator().manual_seed(1)
    hk, head_dim, num_blocks, block_size = 3, 5, 7 if tokens == 9 else 30, 4
    qkv = torch.randn(tokens, 4 * hk * head_dim, generator=gen).to(dtype)
    _, k, v = qkv.split((2 * hk * head_dim, hk * head_dim, hk * head_dim), dim=-1)
    k, v = k.reshape(tokens, hk, head_dim), v.reshape(tokens, hk, head_dim)
    slots = torch.tensor([0, 27, -1, 5, 6, 13, -1, 26, 1]) if tokens == 9 else torch.randperm(120, generator=gen)[:tokens]
    if tokens == 100:
        slots[::7] = -1
    caches = [torch.randn(num_blocks, block_size, hk, head_dim, generator=gen).to(dtype) for _ in range(2)]
    expect = [c.clone() for c in caches]
    kv_write.write_kv(k, v, *expect, slots)
    cpu_layer_ops.write_kv(k, v, *caches, slots)
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])


@pytest.mark.parametrize("tokens", [1, 80])
def test_write_kv_refuses_a_slot_outside_the_cache(tokens):
    k = v = torch.randn(tokens, 1, 4)
    caches = torch.zeros(30, 4, 1, 4), torch.zeros(30, 4, 1, 4)
    slots = torch.arange(tokens)
    slots[-1] = 120   # the last row's: nothing is written, not even the rows before it
    with pytest.raises(IndexError):
        cpu_layer_ops.write_kv(k, v, *caches, slots)
    assert not caches[0].any() and not caches[1].any()


def test_other_dtypes_take_the_reference():
    x = torch.randn(3, 8, dtype=torch.float16)
    weight = torch.ones(8, dtype=torch.float16)
    assert torch.equal(cpu_layer_ops.rms_norm(x, weight, 1e-6), rms_norm.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,half", [(1, 1), (3, 7), (2, 1536), (70, 33)])
def test_silu_and_mul_matches_the_reference(each_build, dtype, rows, half, poisoned_empty):
    gen = torch.Generator().manual_seed(rows + half)
    x = (torch.randn(rows, 2 * half, generator=gen) * 6).to(dtype)
    x[0, 0] = -100.0       # e^100 overflows a float: silu must still be -0
    _close(cpu_layer_ops.silu_and_mul(x), activation.silu_and_mul(x))


def test_silu_and_mul_keeps_nan(each_build):
    x = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]])
    assert cpu_layer_ops.silu_and_mul(x)[0, 0].isnan()
    wide = torch.ones(1, 2 * 19)                   # lanes of 8 (and 16), then the rest one by one
    wide[0, 5] = wide[0, 17] = float("nan")
    got = cpu_layer_ops.silu_and_mul(wide)[0]
    assert got[5].isnan() and got[17].isnan() and not got[[0, 16, 18]].isnan().any()
