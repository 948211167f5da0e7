"""The Triton paged-attention kernels (single pass and split-KV) against the torch reference."""

import pytest
import torch

from kernels import get_ops
from kernels.paged_attention_triton import PROGRAMS_PER_SM, choose_num_splits
from tests.kernels.batches import make_batch
from tests.kernels.conftest import DEVICE

TORCH = get_ops("torch", "cpu")
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}

CASES = {
    "decode": [(1, 1), (1, 17), (1, 70), (1, 33)],
    "prefill": [(7, 7), (33, 33), (1, 1)],
    "chunked_prefill": [(5, 37), (16, 80), (3, 19)],
    "mixed": [(1, 29), (9, 9), (1, 1), (6, 50), (1, 64), (20, 20)],
}


@pytest.fixture(scope="module")
def triton_ops():
    return get_ops("triton", DEVICE)


def _check(triton_ops, batch, dtype, num_splits=None):
    out = triton_ops.paged_attention(*batch.args(), num_splits=num_splits)
    # The oracle runs in float32 on the same (rounded) inputs.
    ref_args = [a.cpu().float() if torch.is_tensor(a) and a.is_floating_point() else
                a.cpu() if torch.is_tensor(a) else a for a in batch.args()]
    expected = TORCH.paged_attention(*ref_args)
    assert out.dtype == dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.cpu().float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


# Every case at head dim 64; head dim 128 on the decode and mixed cases (the interpreter is slow).
FLOAT32_CASES = [(case, 64) for case in sorted(CASES)] + [("decode", 128), ("mixed", 128)]


@pytest.mark.parametrize("case,head_dim", FLOAT32_CASES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (7, 1)], ids=["gqa1", "gqa4", "gqa7"])
def test_float32(triton_ops, poisoned_empty, case, head_dim, heads):
    batch = make_batch(CASES[case], *heads, head_dim=head_dim, block_size=16, device=DEVICE)
    _check(triton_ops, batch, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_half_precision(triton_ops, poisoned_empty, dtype, case):
    batch = make_batch(CASES[case], 8, 2, head_dim=128, block_size=16, dtype=dtype, device=DEVICE)
    _check(triton_ops, batch, dtype)


@pytest.mark.parametrize("block_size", [5, 32])
def test_block_sizes_that_do_not_divide_the_key_tile(triton_ops, poisoned_empty, block_size):
    batch = make_batch(CASES["mixed"], 8, 2, head_dim=64, block_size=block_size, device=DEVICE)
    _check(triton_ops, batch, torch.float32)


SPLIT_CASES = {"decode": CASES["decode"], "mixed": [(1, 29), (6, 50), (1, 70)]}


@pytest.mark.parametrize("case,num_splits", [("decode", 2), ("decode", 8), ("mixed", 3)])
def test_split_kv(triton_ops, poisoned_empty, case, num_splits):
    # 8 splits of a 70-token context leave some splits empty; 3 is not a power of two.
    batch = make_batch(SPLIT_CASES[case], 7, 1, head_dim=64, block_size=16, device=DEVICE)
    _check(triton_ops, batch, torch.float32, num_splits=num_splits)


def test_split_kv_half_precision(triton_ops, poisoned_empty):
    batch = make_batch([(1, 200), (1, 5)], 4, 1, head_dim=128, block_size=16, dtype=torch.float16, device=DEVICE)
    _check(triton_ops, batch, torch.float16, num_splits=4)


def test_block_ids_past_int32_offsets(triton_ops):
    """block_id * block stride exceeds 2**31 elements: offsets must be computed in int64.

    The big caches are allocated but only the used blocks are written, so the OS commits just
    the pages touched (a few KiB of a 4 GiB virtual allocation per cache)."""
    block_size, heads, head_dim = 16, 1, 16
    per_block = block_size * heads * head_dim
    num_blocks = 2**31 // per_block + 64
    batch = make_batch([(1, 40), (3, 20)], 4, heads, head_dim=head_dim, block_size=block_size, dtype=torch.float16)
    expected = TORCH.paged_attention(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                       for a in batch.args()])
    # Move every used block to the far end of a big cache.
    used = batch.block_tables.unique().long()
    far = num_blocks - 1 - torch.arange(used.numel())
    remap = torch.zeros(batch.k_cache.shape[0], dtype=torch.int64)
    remap[used] = far
    big_k = torch.empty((num_blocks, block_size, heads, head_dim), dtype=torch.float16, device=DEVICE)
    big_v = torch.empty_like(big_k)
    big_k[far.to(DEVICE)] = batch.k_cache[used].to(DEVICE)
    big_v[far.to(DEVICE)] = batch.v_cache[used].to(DEVICE)
    batch.block_tables = remap[batch.block_tables.long()].to(torch.int32)
    assert int(batch.block_tables.max()) * per_block > 2**31
    batch.k_cache, batch.v_cache = big_k, big_v
    for name in ("q", "block_tables", "seq_lens", "query_start_loc"):
        setattr(batch, name, getattr(batch, name).to(DEVICE))
    for num_splits in (1, 2):
        out = triton_ops.paged_attention(*batch.args(), num_splits=num_splits)
        torch.testing.assert_close(out.cpu().float(), expected, atol=1e-2, rtol=1e-2)


def test_write_kv_slots_past_int32_offsets(triton_ops):
    block_size, heads, head_dim = 16, 1, 16
    num_blocks = 2**31 // (block_size * heads * head_dim) + 64
    k_cache = torch.empty((num_blocks, block_size, heads, head_dim), dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    k = torch.randn(3, heads, head_dim).half().to(DEVICE)
    v = torch.randn(3, heads, head_dim).half().to(DEVICE)
    slots = torch.tensor([(num_blocks - 1) * block_size + 3, 5, (num_blocks - 40) * block_size], device=DEVICE)
    triton_ops.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[num_blocks - 1, 3], k[0]) and torch.equal(v_cache[num_blocks - 1, 3], v[0])
    assert torch.equal(k_cache[0, 5], k[1]) and torch.equal(v_cache[num_blocks - 40, 0], v[2])


def test_split_heuristic_only_splits_small_decode_batches():
    cpu, h200 = torch.device("cpu"), 132   # the choices that measured fastest on an H200's 132 SMs
    assert choose_num_splits(1, 8, 1, 32768, 64, cpu, h200) == 64
    assert choose_num_splits(16, 8, 1, 4096, 64, cpu, h200) == 8
    assert choose_num_splits(64, 8, 1, 2048, 64, cpu, h200) == 1     # two programs an SM already
    assert choose_num_splits(256, 8, 1, 1024, 64, cpu, h200) == 1
    assert choose_num_splits(1, 8, 7, 32768, 64, cpu, h200) == 1     # prefill never splits
    assert choose_num_splits(1, 8, 1, 600, 64, cpu, h200) == 2       # four key tiles a split at least
    assert choose_num_splits(1, 1, 1, 100, 64, cpu, h200) == 1       # too short to be worth it
    assert choose_num_splits(1, 1, 1, 32768, 64, cpu) == PROGRAMS_PER_SM   # the CPU counts as one SM
