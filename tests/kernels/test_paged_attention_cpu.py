"""The CPU paged-attention kernels (paged_attention_cpu.c, float32 and bfloat16) against a float64 oracle
and the torch reference."""

import pytest
import torch

from kernels import cpu_native, get_ops, paged_attention_cpu
from kernels.paged_attention_cpu import MAX_QUERY_LEN, paged_attention
from tests.kernels.batches import make_batch, naive_attention

pytestmark = [pytest.mark.skipif(not cpu_native.available(), reason="no AVX2 CPU or no C compiler"),
              pytest.mark.usefixtures("each_build")]   # every test on both builds

TORCH = get_ops("torch", "cpu")
CASES = {
    "decode": [(1, 1), (1, 17), (1, 70), (1, 33), (1, 300)],
    "verify": [(9, 9), (5, 37), (1, 29), (16, 80), (3, 19)],   # k + 1 positions, short chunks, a decode
}


@pytest.fixture(autouse=True)
def kernel_takes_a_tile(monkeypatch):
    """Query runs of up to 16 tokens (a query tile) go through the kernel here, wherever the launcher
    draws its line for speed."""
    for dtype in list(MAX_QUERY_LEN):
        monkeypatch.setitem(MAX_QUERY_LEN, dtype, 16)


# A bf16 output is the float64 result rounded once: at most half a bf16 ulp (2**-8 of the value)
# away, plus float32 arithmetic's error.
BF16_RTOL, BF16_ATOL = 2**-8 * 1.01, 1e-5


def _assert_matches_oracle(batch):
    out = paged_attention(*batch.args())
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), naive_attention(batch), atol=BF16_ATOL, rtol=BF16_RTOL)
        return
    torch.testing.assert_close(out, naive_attention(batch).float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, TORCH.paged_attention(*batch.args()), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (7, 1)], ids=["mha", "gqa3", "gqa7"])
@pytest.mark.parametrize("head_dim", [64, 20, 128])
def test_matches_oracle(poisoned_empty, case, heads, head_dim):
    _assert_matches_oracle(make_batch(CASES[case], *heads, head_dim=head_dim, block_size=16))


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_block_sizes(poisoned_empty, block_size):
    _assert_matches_oracle(make_batch(CASES["verify"], 8, 2, head_dim=64, block_size=block_size))


MIXED = [(1, 1), (16, 16), (3, 19), (1, 300), (9, 40), (16, 81), (2, 33), (5, 5), (1, 70)]   # query lens 1..16


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("head_dim", [5, 33, 64])
def test_bf16_matches_oracle(poisoned_empty, block_size, heads, head_dim):
    _assert_matches_oracle(make_batch(MIXED, *heads, head_dim=head_dim, block_size=block_size,
                                      dtype=torch.bfloat16, seed=block_size))


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("heads", [(32, 8), (12, 2), (32, 2), (34, 2)], ids=["gqa4", "gqa6", "gqa16", "gqa17"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_groups_of_any_width_match_oracle(poisoned_empty, block_size, heads, head_dim):
    """Where AMX is, a bf16 cache's scores take its tiles for groups of up to 16 query heads, four heads
    per softmax (6: a set of four and one of two), the keys loaded in place where a step's 16 fill one block
    and gathered where not (blocks of 5, a sequence's last step); 17 stays on the vector kernel."""
    _assert_matches_oracle(make_batch(MIXED, *heads, head_dim=head_dim, block_size=block_size,
                                      dtype=torch.bfloat16, seed=head_dim + block_size))


def test_bf16_and_float32_run_the_kernels(monkeypatch):
    """Each dtype reaches its own kernel through the launcher, not the reference."""
    batch = make_batch(MIXED, 9, 3, head_dim=64, block_size=16)
    expected = paged_attention(*batch.args())
    monkeypatch.setattr("kernels.paged_attention_cpu.reference_paged_attention", None)
    torch.testing.assert_close(expected, naive_attention(batch).float(), atol=2e-5, rtol=2e-5)
    batch.q, batch.k_cache, batch.v_cache = (t.bfloat16() for t in (batch.q, batch.k_cache, batch.v_cache))
    out = paged_attention(*batch.args())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=BF16_ATOL, rtol=BF16_RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_longer_than_a_query_tile(poisoned_empty, monkeypatch, dtype):
    """The kernel cuts chunks into 16-token tiles; the launcher sends it none that long, so lift its limit."""
    monkeypatch.setitem(MAX_QUERY_LEN, dtype, 64)
    monkeypatch.setattr("kernels.paged_attention_cpu.reference_paged_attention", None)
    _assert_matches_oracle(make_batch([(40, 100), (17, 17), (1, 50), (33, 70)], 9, 3, head_dim=33, block_size=16,
                                      dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_batch(dtype):
    shapes = CASES["decode"] + CASES["verify"]
    whole = make_batch(shapes, 9, 3, head_dim=64, block_size=16, seed=3, dtype=dtype)
    out = paged_attention(*whole.args())
    starts = whole.query_start_loc.tolist()
    for b in range(len(shapes)):
        alone_args = list(whole.args())
        alone_args[3] = whole.block_tables[b:b + 1]
        alone_args[4] = whole.seq_lens[b:b + 1]
        q_len = starts[b + 1] - starts[b]
        alone_args[0] = whole.q[starts[b]:starts[b + 1]]
        alone_args[5] = torch.tensor([0, q_len], dtype=torch.int32)
        alone_args[6] = q_len
        assert torch.equal(paged_attention(*alone_args), out[starts[b]:starts[b + 1]])


# The decode kernel walks a context longer than 512 keys in parts of 512 from key 0, and merges them.
LONG = [(1, 1500), (5, 515), (1, 513), (16, 1100), (1, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa3", "mha"])
def test_long_contexts_in_parts_match_oracle(poisoned_empty, dtype, heads):
    _assert_matches_oracle(make_batch(LONG, *heads, head_dim=64, block_size=16, dtype=dtype, seed=5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verified_row_is_the_row_decoded_alone(dtype):
    """Speculative decoding's exactness needs a verification row (here 5 tokens whose contexts end at keys
    510..514, on both sides of a part's edge) to be the same bits as that token decoded alone."""
    batch = make_batch([(5, 515)], 9, 3, head_dim=64, block_size=16, dtype=dtype, seed=6)
    rows = paged_attention(*batch.args())
    for i in range(5):
        alone = list(batch.args())
        alone[0] = batch.q[i:i + 1]
        alone[4] = torch.tensor([511 + i], dtype=torch.int32)
        alone[5] = torch.tensor([0, 1], dtype=torch.int32)
        alone[6], alone[7] = 1, 511 + i
        assert torch.equal(paged_attention(*alone), rows[i:i + 1])


# Few tiles are split over KV heads between threads, many are not: the bits must not change either way.
@pytest.mark.parametrize("shapes", [CASES["decode"] + CASES["verify"], [(1, 300)], [(4, 70), (1, 33)], LONG],
                         ids=["many-tiles", "one-decode", "few-tiles", "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_give_the_same_bits(dtype, shapes):
    batch = make_batch(shapes, 9, 3, head_dim=64, block_size=16, seed=4, dtype=dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(*batch.args())
        torch.set_num_threads(2)
        two = paged_attention(*batch.args())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.fixture
def prefetch_level_kept():
    """The loaded library's prefetch level, put back after the test."""
    lib = cpu_native.library()
    before = lib.matinee_attention_prefetch_to(0)
    yield lib
    lib.matinee_attention_prefetch_to(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_where_the_prefetches_go_changes_no_bits(prefetch_level_kept, dtype):
    """Into L1 or L2 (measured per machine), a prefetch moves when a line arrives, never a result."""
    lib = prefetch_level_kept
    batch = make_batch(CASES["decode"] + CASES["verify"] + [(1, 700)], 9, 3, head_dim=64, block_size=16, seed=5,
                       dtype=dtype)
    outs = []
    for level in (1, 2):
        assert lib.matinee_attention_prefetch_to(level) == level
        outs.append(paged_attention(*batch.args()))
    assert torch.equal(outs[0], outs[1])
    _assert_matches_oracle(batch)


def test_prefetches_go_into_l2_only_where_that_measures_faster():
    assert paged_attention_cpu.prefetch_level({"l1": 6.3, "l2": 3.0}) == "l2"
    assert paged_attention_cpu.prefetch_level({"l1": 3.0, "l2": 6.3}) == "l1"
    assert paged_attention_cpu.prefetch_level({"l1": 3.1, "l2": 3.0}) == "l1"   # within the margin: L1 stays
    assert paged_attention_cpu.prefetch_level({"l1": 3.3, "l2": 3.0}) == "l2"   # 10% faster: L2


def test_the_library_prefetches_where_its_measurement_says(monkeypatch, prefetch_level_kept):
    lib = prefetch_level_kept
    for ms, level in (({"l1": 6.0, "l2": 3.0}, 2), ({"l1": 3.0, "l2": 6.0}, 1)):
        monkeypatch.setattr(cpu_native, "kept_measurement", lambda suffix, name, measure, lib=None, ms=ms: ms)
        assert paged_attention_cpu.choose_prefetch(lib) == ("l2" if level == 2 else "l1")
        assert lib.matinee_attention_prefetch_to(0) == level


def test_a_measurement_that_fails_leaves_l1(monkeypatch, prefetch_level_kept):
    lib = prefetch_level_kept
    lib.matinee_attention_prefetch_to(1)

    def no_memory(lib, repeats=3):
        raise MemoryError("no memory for the probe's caches")
    monkeypatch.setattr(cpu_native, "kept_measurement", lambda suffix, name, measure, lib=None: measure())
    monkeypatch.setattr(paged_attention_cpu, "measure_prefetch", no_memory)
    assert paged_attention_cpu.choose_prefetch(lib) == "l1"
    assert lib.matinee_attention_prefetch_to(0) == 1


def test_the_measurement_times_both_levels_and_leaves_the_level(monkeypatch, prefetch_level_kept):
    lib = prefetch_level_kept
    monkeypatch.setattr(cpu_native, "last_level_cache_bytes", lambda: 1 << 20)   # the 2-layer minimum
    lib.matinee_attention_prefetch_to(2)
    ms = paged_attention_cpu.measure_prefetch(lib, repeats=1)
    assert set(ms) == {"l1", "l2"} and all(v > 0 for v in ms.values())
    assert lib.matinee_attention_prefetch_to(0) == 2


# Prefill chunks beside decodes and verifications, as a step mixes them: fresh prompts (the chunk is the
# whole sequence), chunks after a cached past, lengths off the block size.
PREFILL_MIX = [(40, 40), (1, 30), (3, 19), (17, 100), (1, 5), (33, 33), (2, 2), (70, 71)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa3", "mha"])
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_chunks_beside_short_runs(poisoned_empty, monkeypatch, dtype, heads, block_size):
    """Chunks longer than the decode kernel's limit go to the prefill kernel; the short runs of the same
    batch go through the decode kernel, with the very bits they get in a batch of their own."""
    monkeypatch.setitem(MAX_QUERY_LEN, dtype, 4)
    monkeypatch.setattr("kernels.paged_attention_cpu.reference_paged_attention", None)
    batch = make_batch(PREFILL_MIX, *heads, head_dim=64, block_size=block_size, dtype=dtype, seed=block_size)
    _assert_matches_oracle_only(batch)
    out = paged_attention(*batch.args())
    starts = batch.query_start_loc.tolist()
    short = [b for b in range(len(PREFILL_MIX)) if PREFILL_MIX[b][0] <= 4]
    rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in short])
    q_lens = [PREFILL_MIX[b][0] for b in short]
    alone = paged_attention(batch.q[rows], batch.k_cache, batch.v_cache, batch.block_tables[short],
                            batch.seq_lens[short], torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
                            max(q_lens), int(batch.seq_lens[short].max()), batch.scale)
    assert torch.equal(out[rows], alone)


def _assert_matches_oracle_only(batch):
    out = paged_attention(*batch.args())
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    tol = (BF16_ATOL, BF16_RTOL) if out.dtype == torch.bfloat16 else (2e-5, 2e-5)
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=tol[0], rtol=tol[1])


# The prefill kernel: a work item holds up to 48 rows (24 on AVX2) of one KV head, 48 // group tokens, and
# walks the context 32 keys at a time; these runs end mid-item and mid-block, or fit in one, after a past
# or none.
PREFILL_RUNS = [(100, 100), (1, 1), (37, 250), (6, 6), (17, 33), (64, 64), (49, 80), (2, 300)]


def _prefill_kernel_only(monkeypatch, limit=0):
    """Every run longer than `limit` goes to the prefill kernel: SDPA and the reference would raise."""
    def refuse(*args, **kwargs):
        raise AssertionError("a prefill chunk left the kernel")
    for dtype in list(MAX_QUERY_LEN):
        monkeypatch.setitem(MAX_QUERY_LEN, dtype, limit)
    monkeypatch.setattr("kernels.paged_attention_cpu.reference_paged_attention", refuse)
    monkeypatch.setattr("kernels.paged_attention_cpu.F.scaled_dot_product_attention", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (7, 1), (32, 2)], ids=["gqa3", "mha", "gqa7", "gqa16"])
@pytest.mark.parametrize("head_dim", [64, 40, 128])
def test_prefill_kernel_matches_oracle(poisoned_empty, monkeypatch, dtype, heads, head_dim):
    batch = make_batch(PREFILL_RUNS, *heads, head_dim=head_dim, block_size=16, dtype=dtype, seed=head_dim)
    _prefill_kernel_only(monkeypatch)
    _assert_matches_oracle_only(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_prefill_kernel_block_sizes(poisoned_empty, monkeypatch, block_size, dtype):
    """Keys gathered across blocks of any size (on an AMX CPU, bf16 runs there: 32 keys at a time)."""
    batch = make_batch(PREFILL_RUNS, 9, 3, head_dim=64, block_size=block_size, seed=block_size, dtype=dtype)
    _prefill_kernel_only(monkeypatch)
    _assert_matches_oracle_only(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [0, 4], ids=["prefill", "mixed"])
def test_prefill_kernel_rows_do_not_depend_on_the_batch_or_threads(monkeypatch, dtype, limit):
    """A run's bits are its own: alone or beside others (with limit 4, the short runs beside the chunks
    in one call take the decode kernel), with one thread or two."""
    _prefill_kernel_only(monkeypatch, limit)
    whole = make_batch(PREFILL_RUNS, 9, 3, head_dim=64, block_size=16, seed=5, dtype=dtype)
    out = paged_attention(*whole.args())
    starts = whole.query_start_loc.tolist()
    for b in range(len(PREFILL_RUNS)):
        q_len = starts[b + 1] - starts[b]
        alone = paged_attention(whole.q[starts[b]:starts[b + 1]], whole.k_cache, whole.v_cache,
                                whole.block_tables[b:b + 1], whole.seq_lens[b:b + 1],
                                torch.tensor([0, q_len], dtype=torch.int32), q_len, int(whole.seq_lens[b]),
                                whole.scale)
        assert torch.equal(alone, out[starts[b]:starts[b + 1]])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(*whole.args())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, out)


def test_prefill_chunks_of_other_head_sizes_take_sdpa(poisoned_empty, monkeypatch):
    """D not a multiple of 8: the chunks run SDPA on their own context (the kernel would refuse them)."""
    for dtype in list(MAX_QUERY_LEN):
        monkeypatch.setitem(MAX_QUERY_LEN, dtype, 4)
    real, runs = paged_attention_cpu._kernel, []

    def short_runs_only(lib, q, *args):
        runs.append(q.shape[0])
        starts = args[4].tolist()
        assert max(b - a for a, b in zip(starts, starts[1:])) <= 4, "a long run reached the C kernels"
        return real(lib, q, *args)
    monkeypatch.setattr(paged_attention_cpu, "_kernel", short_runs_only)
    _assert_matches_oracle_only(make_batch(PREFILL_RUNS, 9, 3, head_dim=20, block_size=16))
    assert runs, "the short runs went through the decode kernel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunk_metadata_is_checked(dtype):
    batch = make_batch([(20, 20), (1, 12)], 8, 2, head_dim=64, block_size=16, dtype=dtype)
    args = list(batch.args())
    args[4] = torch.tensor([40, 12], dtype=torch.int32)   # past its block table
    with pytest.raises(ValueError, match="disagree"):
        paged_attention(*args)
    args = list(batch.args())
    args[4] = torch.tensor([10, 12], dtype=torch.int32)   # 20 new tokens in a sequence of 10
    with pytest.raises(ValueError, match="disagree"):
        paged_attention(*args)
    args = list(batch.args())
    args[3] = batch.block_tables.clone()
    args[3][0, 0] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="out of range"):
        paged_attention(*args)


def test_other_dtypes_use_the_reference():
    half = make_batch(CASES["decode"] + [(20, 30)], 8, 2, head_dim=64, block_size=16, dtype=torch.float16)
    assert torch.equal(paged_attention(*half.args()), TORCH.paged_attention(*half.args()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_ids_past_int32_offsets(dtype):
    """block_id * block stride exceeds 2**31 elements: the kernel's offsets are 64-bit. Only the
    used blocks of the big caches are written, so the OS commits just the pages touched."""
    block_size, heads, head_dim = 16, 1, 16
    per_block = block_size * heads * head_dim
    num_blocks = 2**31 // per_block + 64
    batch = make_batch([(1, 40), (3, 20)], 4, heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    expected = paged_attention(*batch.args())
    used = batch.block_tables.unique().long()
    far = num_blocks - 1 - torch.arange(used.numel())
    remap = torch.zeros(batch.k_cache.shape[0], dtype=torch.int64)
    remap[used] = far
    big_k = torch.empty((num_blocks, block_size, heads, head_dim), dtype=dtype)
    big_v = torch.empty_like(big_k)
    big_k[far] = batch.k_cache[used]
    big_v[far] = batch.v_cache[used]
    batch.block_tables = remap[batch.block_tables.long()].to(torch.int32)
    assert int(batch.block_tables.max()) * per_block > 2**31
    batch.k_cache, batch.v_cache = big_k, big_v
    assert torch.equal(paged_attention(*batch.args()), expected)   # the same rows, read from far away


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inconsistent_metadata_is_refused(dtype):
    batch = make_batch(CASES["decode"], 8, 2, head_dim=64, block_size=16, dtype=dtype)
    args = list(batch.args())
    args[4] = batch.seq_lens + 100                     # past the block tables
    with pytest.raises(ValueError, match="disagree"):
        paged_attention(*args)
    args = list(batch.args())
    args[3] = batch.block_tables.clone()
    args[3][0, 0] = batch.k_cache.shape[0]             # a block id past the pool
    with pytest.raises(ValueError, match="out of range"):
        paged_attention(*args)
    args[3] = batch.block_tables.clone()
    args[3][0, -1] = -1                                # even in a table row's unused tail
    with pytest.raises(ValueError, match="out of range"):
        paged_attention(*args)
    verify = make_batch([(3, 19), (1, 5)], 8, 2, head_dim=64, block_size=16, dtype=dtype)
    args = list(verify.args())
    args[4] = torch.tensor([2, 5], dtype=torch.int32)  # 3 new tokens in a sequence of 2
    with pytest.raises(ValueError, match="disagree"):
        paged_attention(*args)
