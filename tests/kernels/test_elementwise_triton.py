"""Triton RMSNorm, rotary, SiLU-and-mul and KV-write kernels against their torch references."""

import pytest
import torch

from kernels import build_cos_sin_cache, get_ops
from tests.kernels.conftest import DEVICE

TORCH = get_ops("torch", "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def triton_ops():
    return get_ops("triton", DEVICE)


def _rand(*shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (7, 129), (3, 1000)])
def test_rms_norm(triton_ops, poisoned_empty, dtype, rows, width):
    x, res, w = _rand(rows, width, dtype=dtype), _rand(rows, width, dtype=dtype, seed=1), _rand(width, dtype=dtype, seed=2)
    _close(triton_ops.rms_norm(x, w, 1e-5), TORCH.rms_norm(x.cpu(), w.cpu(), 1e-5), dtype)
    y, new_res = triton_ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref_y, ref_res = TORCH.fused_add_rms_norm(x.cpu(), res.cpu(), w.cpu(), 1e-5)
    _close(new_res, ref_res, dtype)
    _close(y, ref_y, dtype)


def test_rms_norm_over_heads_of_a_strided_view(triton_ops, poisoned_empty):
    # Per-head q/k norms (Qwen3) normalise [T, H, D] slices of a fused qkv projection.
    qkv = _rand(5, 3 * 4 * 32, dtype=torch.float32)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    w = _rand(32, dtype=torch.float32, seed=3)
    _close(triton_ops.rms_norm(q, w, 1e-6), TORCH.rms_norm(q.cpu(), w.cpu(), 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary(triton_ops, poisoned_empty, dtype, heads, head_dim):
    num_q, num_k = heads
    tokens = 13
    cache = build_cos_sin_cache(
        head_dim, 4096, 500000.0,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 1024},
    ).to(DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    # q and k are strided views into one projection output, as the model produces them.
    qkv = _rand(tokens, (num_q + 2 * num_k) * head_dim, dtype=dtype)
    q = qkv[:, : num_q * head_dim].view(tokens, num_q, head_dim)
    k = qkv[:, num_q * head_dim:(num_q + num_k) * head_dim].view(tokens, num_k, head_dim)
    out_q, out_k = triton_ops.rotary_embedding(positions, q, k, cache)
    ref_q, ref_k = TORCH.rotary_embedding(positions.cpu(), q.cpu(), k.cpu(), cache.cpu())
    _close(out_q, ref_q, dtype)
    _close(out_k, ref_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inner", [(1, 64), (13, 1500)])
def test_silu_and_mul(triton_ops, poisoned_empty, dtype, rows, inner):
    x = _rand(rows, 2 * inner, dtype=dtype)
    _close(triton_ops.silu_and_mul(x), TORCH.silu_and_mul(x.cpu()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_write_kv(triton_ops, dtype, block_size):
    num_blocks, heads, head_dim = 6, 3, 64
    cache_shape = (num_blocks, block_size, heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:11]
    slots[[2, 7]] = -1
    k, v = _rand(11, heads, head_dim, dtype=dtype), _rand(11, heads, head_dim, dtype=dtype, seed=1)
    triton_ops.write_kv(k, v, k_cache, v_cache, slots.to(DEVICE))
    ref_k, ref_v = torch.full(cache_shape, float("nan"), dtype=dtype), torch.full(cache_shape, float("nan"), dtype=dtype)
    TORCH.write_kv(k.cpu(), v.cpu(), ref_k, ref_v, slots)
    torch.testing.assert_close(k_cache.cpu(), ref_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.cpu(), ref_v, equal_nan=True, atol=0, rtol=0)
    assert int((~k_cache.isnan()).any(-1).any(-1).sum()) == 9


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_ops("triton", "cpu")


def test_auto_picks_by_device():
    from kernels import cpu_native

    assert get_ops("auto", "cpu").backend == ("cpu" if cpu_native.available() else "torch")
    if DEVICE == "cuda":
        assert get_ops("auto", "cuda").backend == "triton"
