"""The int8 and fp8 KV cache (kv_quant.py): the write rule, bit for bit in the torch reference, the C
kernel and the Triton kernel (under the interpreter without a GPU), and paged attention over it in
the three against float64 attention on the dequantized K/V."""

import pytest
import torch

from kernels import cpu_layer_ops, cpu_native, get_ops, kv_write
from kernels.kv_quant import QUANTIZED_DTYPES, dequantize
from kernels.paged_attention_cpu import MAX_QUERY_LEN, paged_attention as cpu_paged_attention
from tests.kernels.batches import PagedBatch, make_batch, naive_attention
from tests.kernels.conftest import DEVICE

needs_c = pytest.mark.skipif(not cpu_native.available(), reason="no AVX2 CPU or no C compiler")
TORCH = get_ops("torch", "cpu")
IDS = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


def _triton_write(*args):
    from kernels import kv_write_triton
    return kv_write_triton.write_kv(*[a.to(DEVICE) if torch.is_tensor(a) else a for a in args])


# Each writer with the activation dtypes it takes (Triton's interpreter mishandles bf16).
WRITERS = {"torch": (kv_write.write_kv, (torch.float32, torch.bfloat16, torch.float16)),
           "cpu": (cpu_layer_ops.write_kv, (torch.float32, torch.bfloat16)),
           "triton": (_triton_write, (torch.float32, torch.float16))}


def _empty_cache(dtype, num_blocks=6, block_size=5, heads=3, head_dim=20, device="cpu"):
    shape = (num_blocks, block_size, heads, head_dim)
    # Stale scales: offset 0 of a block must reset its scale, whatever a freed block held.
    scales = torch.rand(num_blocks, heads, generator=torch.Generator().manual_seed(9)) * 50
    return (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
            scales.to(device), scales.clone().to(device))


def _calls(act, heads=3, head_dim=20, seed=1):
    """Three writes into blocks of 5: a prefill that skips a padding slot, decodes, a block's tokens
    apart in one call, magnitudes that grow inside a block (requantization) and an all-zero head."""
    gen = torch.Generator().manual_seed(seed)
    slots = [[5, 6, 7, 8, -1, 9, 0], [10, 11, 1, 2, 12, 13, 14], [15, 3, 16, 4, 17, 18, 19]]
    calls = []
    for i, s in enumerate(slots):
        grow = torch.linspace(0.5, 8, len(s))[:, None, None]
        k = torch.randn(len(s), heads, head_dim, generator=gen) * grow
        v = torch.randn(len(s), heads, head_dim, generator=gen)
        if i == 0:
            k[0, 0] = 0
        calls.append((k.to(act), v.to(act), torch.tensor(s)))
    return calls


def _write_all(writer, calls, caches):
    for k, v, slots in calls:
        writer(k, v, caches[0], caches[1], slots, caches[2], caches[3])
    return [c.cpu().view(torch.uint8) if c.dtype != torch.float32 else c.cpu() for c in caches]


@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=IDS.get)
@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_writers_match_the_reference_bit_for_bit(cache_dtype, name):
    writer, acts = WRITERS[name]
    if name == "cpu" and not cpu_native.available():
        pytest.skip("no AVX2 CPU or no C compiler")
    for act in acts:
        calls = _calls(act)
        expected = _write_all(kv_write.write_kv, calls, _empty_cache(cache_dtype))
        got = _write_all(writer, calls, _empty_cache(cache_dtype, device=DEVICE if name == "triton" else "cpu"))
        for e, g in zip(expected, got):
            assert torch.equal(e, g), (name, act)


@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=IDS.get)
def test_a_block_does_not_depend_on_how_its_writes_were_split(cache_dtype):
    calls = _calls(torch.float32)
    whole = _write_all(kv_write.write_kv, calls, _empty_cache(cache_dtype))
    one_by_one = [(k[i:i + 1], v[i:i + 1], s[i:i + 1]) for k, v, s in calls for i in range(len(s))]
    assert all(torch.equal(a, b) for a, b in zip(whole, _write_all(kv_write.write_kv, one_by_one,
                                                                   _empty_cache(cache_dtype))))


@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=IDS.get)
def test_dequantized_values_are_within_the_stated_error(cache_dtype):
    """int8: each requantization rounds again, so a value is within (1 + growths) / 2 steps of the
    final scale, at most block_size / 2 (here 2.5 steps of amax / 127). fp8: within 2^-4 of the value
    per rounding (3 mantissa bits), plus e4m3's subnormal step, for at most block_size roundings."""
    calls = _calls(torch.float32)
    k_cache, v_cache, k_scales, v_scales = _empty_cache(cache_dtype)
    for k, v, slots in calls:
        kv_write.write_kv(k, v, k_cache, v_cache, slots, k_scales, v_scales)
    k_values = dequantize(k_cache, k_scales).flatten(0, 1)
    for k, _, slots in calls:
        keep = slots >= 0
        got, want = k_values[slots[keep]], k[keep]
        step = k_scales.view(-1, 1, k_scales.shape[1])[slots[keep] // 5][:, 0, :, None]   # each token's block scale
        if cache_dtype == torch.int8:
            assert bool(((got - want).abs() <= 2.5 * step + 1e-6).all())
        else:
            assert bool(((got - want).abs() <= want.abs() * (5 * 2**-4) + 5 * 2**-9 * step + 1e-6).all())
        assert bool((got[want == 0] == 0).all())


def _every_e4m3_value_and_midpoint() -> torch.Tensor:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[values.isfinite()].unique()   # sorted, -448 .. 448
    return torch.cat([values, (values[1:] + values[:-1]) / 2])


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_fp8_codes_round_as_torch_casts(name):
    """Every e4m3 value and every tie between two neighbours, written with a scale of exactly 1 (each
    token's largest value is 448), gives torch's float8_e4m3fn bits."""
    writer = WRITERS[name][0]
    if name == "cpu" and not cpu_native.available():
        pytest.skip("no AVX2 CPU or no C compiler")
    values = _every_e4m3_value_and_midpoint()
    per_token = 63
    tokens = -(-values.numel() // per_token)
    x = torch.zeros(tokens * per_token)
    x[:values.numel()] = values
    x = torch.cat([x.view(tokens, per_token), torch.full((tokens, 1), 448.0)], dim=1).view(tokens, 1, 64)
    device = DEVICE if name == "triton" else "cpu"
    caches = _empty_cache(torch.float8_e4m3fn, num_blocks=tokens, block_size=1, heads=1, head_dim=64, device=device)
    codes = _write_all(writer, [(x, x, torch.arange(tokens))], caches)
    assert torch.equal(codes[2], torch.ones(tokens, 1))
    assert torch.equal(codes[0].view(tokens, 64), x.view(tokens, 64).to(torch.float8_e4m3fn).view(torch.uint8))


# ---- attention --------------------------------------------------------------------------------

MIXED = [(1, 1), (5, 5), (3, 19), (1, 41), (9, 40), (1, 70), (2, 33)]   # decodes, verifications, chunks
LONG = [(1, 1300), (5, 515), (1, 20)]   # contexts the decode kernel walks in parts of 512 keys, and merges
SHAPES = [(9, 3, 20, 5), (8, 2, 64, 16), (7, 1, 33, 16), (4, 4, 64, 3)]   # Hq, Hk, D, block size


def quantized_batch(shapes, num_q_heads, num_kv_heads, head_dim, block_size, cache_dtype, dtype=torch.float32,
                    seed=0) -> tuple[PagedBatch, torch.Tensor, torch.Tensor, PagedBatch]:
    """A batch over an int8 or fp8 cache with random codes and scales per (block, head), and the same
    batch over their dequantized float32 values."""
    batch = make_batch(shapes, num_q_heads, num_kv_heads, head_dim=head_dim, block_size=block_size,
                       dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    caches, scales = [], []
    for _ in range(2):
        shape = batch.k_cache.shape
        if cache_dtype == torch.int8:
            codes = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
        else:
            codes = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        caches.append(codes)
        scales.append(torch.rand(shape[0], shape[2], generator=gen) / 40 + 0.005)
    dequantized = PagedBatch(batch.q.float(), dequantize(caches[0], scales[0]), dequantize(caches[1], scales[1]),
                             batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.max_query_len,
                             batch.max_seq_len, batch.scale)
    batch.k_cache, batch.v_cache = caches
    return batch, scales[0], scales[1], dequantized


def _oracle(dequantized: PagedBatch) -> torch.Tensor:
    return naive_attention(dequantized)


@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=IDS.get)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_torch_reference(poisoned_empty, cache_dtype, shape):
    batch, k_scales, v_scales, dequantized = quantized_batch(MIXED, *shape, cache_dtype)
    out = TORCH.paged_attention(*batch.args(), k_scales=k_scales, v_scales=v_scales)
    torch.testing.assert_close(out, _oracle(dequantized).float(), atol=2e-5, rtol=2e-5)


@pytest.fixture
def kernel_takes_a_tile(monkeypatch):
    """Query runs of up to 16 tokens go through the C kernel here, wherever its launcher draws its line."""
    for dtype in list(MAX_QUERY_LEN):
        monkeypatch.setitem(MAX_QUERY_LEN, dtype, 16)


@needs_c
@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=IDS.get)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("runs", [MIXED, LONG], ids=["mixed", "long"])
def test_cpu_kernel(poisoned_empty, kernel_takes_a_tile, each_build, cache_dtype, dtype, shape, runs, monkeypatch):
    batch, k_scales, v_scales, dequantized = quantized_batch(runs, *shape, cache_dtype, dtype=dtype)
    # Nothing may reach the reference: every query run here is short enough for the kernel.
    monkeypatch.setattr("kernels.paged_attention_cpu.reference_paged_attention",
                        lambda *a, **kw: pytest.fail("fell back to the reference"))
    out = cpu_paged_attention(*batch.args(), k_scales=k_scales, v_scales=v_scales)
    assert out.dtype == dtype
    if dtype == torch.bfloat16:   # the float64 result rounded once, plus float32 arithmetic's error
        torch.testing.assert_close(out.double(), _oracle(dequantized), atol=1e-5, rtol=2**-8 * 1.01)
    else:
        torch.testing.assert_close(out, _oracle(dequantized).float(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=IDS.get)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 1e-2)], ids=["f32", "f16"])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_triton_kernel(poisoned_empty, cache_dtype, dtype, tol, num_splits):
    triton_ops = get_ops("triton", DEVICE)
    for shape in SHAPES[:2]:   # the interpreter is slow: GQA at an odd head dim and block size, and SmolLM2's
        shapes = MIXED if num_splits is None else [(1, 41), (1, 70), (1, 3)]
        batch, k_scales, v_scales, dequantized = quantized_batch(shapes, *shape, cache_dtype, dtype=dtype)
        args = [a.to(DEVICE) if torch.is_tensor(a) else a for a in batch.args()]
        out = triton_ops.paged_attention(*args, k_scales=k_scales.to(DEVICE), v_scales=v_scales.to(DEVICE),
                                         num_splits=num_splits)
        assert out.dtype == dtype
        torch.testing.assert_close(out.cpu().float(), _oracle(dequantized).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("ops_name", ["torch", "cpu", "triton"])
def test_missing_or_misshapen_scales_are_refused(ops_name):
    if ops_name == "cpu" and not cpu_native.available():
        pytest.skip("no AVX2 CPU or no C compiler")
    ops = get_ops(ops_name, DEVICE if ops_name == "triton" else "cpu")
    batch, k_scales, v_scales, _ = quantized_batch([(1, 7)], 4, 2, 16, 4, torch.int8)
    for bad in (None, k_scales[:1], k_scales.double()):
        with pytest.raises(ValueError, match="needs k_scales"):
            ops.paged_attention(*batch.args(), k_scales=bad, v_scales=v_scales)
        with pytest.raises(ValueError, match="needs k_scales"):
            ops.write_kv(batch.q[:, :2], batch.q[:, :2], batch.k_cache, batch.v_cache, torch.tensor([0]),
                         bad, v_scales)


@needs_c
@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=IDS.get)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cpu_prefill_chunks_beside_short_runs(poisoned_empty, each_build, cache_dtype, dtype, monkeypatch):
    """A step's prefill chunks (past the decode kernel's limit) read the quantized cache through the prefill
    kernel, its decodes through the decode kernel, in one batch."""
    monkeypatch.setitem(MAX_QUERY_LEN, dtype, 4)
    batch, k_scales, v_scales, dequantized = quantized_batch([(20, 20), (1, 37), (3, 19), (9, 40)], *SHAPES[0],
                                                             cache_dtype, dtype=dtype)
    out = cpu_paged_attention(*batch.args(), k_scales=k_scales, v_scales=v_scales)
    assert out.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), _oracle(dequantized), atol=1e-5, rtol=2**-8 * 1.01)
    else:
        torch.testing.assert_close(out, _oracle(dequantized).float(), atol=2e-5, rtol=2e-5)
