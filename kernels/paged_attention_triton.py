"""Paged attention over a mixed batch as Triton kernels, with a split-KV (flash-decoding) path.

One program takes a tile of one sequence's new query tokens for one KV head, with all the
query heads that share that KV head stacked as rows (GQA costs no extra K/V reads), and
streams the sequence's keys through its block table with an online softmax, in the manner
of the Triton fused-attention tutorial. When a decode batch has too few (sequence, KV head)
pairs to fill the GPU, each pair's keys are cut into NUM_SPLITS ranges that run in parallel
and a second kernel merges the partial softmaxes. Reference: paged_attention.py.

An int8 or fp8 cache (kv_quant.py) is read as codes, turned into the queries' dtype (exact: int8
and e4m3 values fit in float16 and bfloat16), and its scales applied outside the matmuls: a key's
to its column of scores, a value's to its column of softmax weights.
"""

import torch
import triton
import triton.language as tl

from kernels.kv_codes_triton import code_values
from kernels.kv_quant import check_scales, is_quantized

LOG2E = 1.4426950408889634
PROGRAMS_PER_SM = 4


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, k_scales_ptr, v_scales_ptr,
    scale_log2, num_seqs, num_q_heads, num_kv_heads, head_dim, block_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_table,
    QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr, FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Binary search for the sequence owning this tile. Sequence b's tiles are numbered from
    # query_start_loc[b] // BLOCK_Q + b: that leaves room for its ceil(q_len / BLOCK_Q) tiles
    # without a prefix sum, at the cost of a few idle programs. (Inline rather than a helper:
    # the interpreter pays dearly for every nested jit call.) Both bounds start as int32
    # tensors: loop-carried values must keep one type.
    lo = num_seqs * 0
    hi = num_seqs + 0
    while lo < hi:
        mid = (lo + hi) // 2
        go_right = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r is query token r // QUERIES_PER_KV of this tile, head r % QUERIES_PER_KV of the group.
    rows = tl.arange(0, BLOCK_M)
    token = tile_in_seq * BLOCK_Q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_ok = (rows // QUERIES_PER_KV < BLOCK_Q) & (token < q_len)
    cols = tl.arange(0, HEAD_PAD)
    col_ok = cols < head_dim
    q_row = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :], other=0.0,
    )
    query_pos = context_len + token

    # Keys this tile needs: up to the position of its last valid query token.
    kv_end = tl.minimum(seq_len, context_len + tl.minimum((tile_in_seq + 1) * BLOCK_Q, q_len))
    if NUM_SPLITS == 1:
        kv_lo = 0
        kv_hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), TILE_N) * TILE_N
        kv_lo = split * per_split
        kv_hi = tl.minimum(kv_end, kv_lo + per_split)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    for start in range(kv_lo, kv_hi, TILE_N):
        key_pos = start + tl.arange(0, TILE_N)
        key_ok = key_pos < kv_hi
        # int64 before multiplying by the block stride: block ids times a block's element
        # count overflow int32 on large caches.
        block = tl.load(table_row + key_pos // block_size, mask=key_ok, other=0).to(tl.int64)
        offset = key_pos % block_size
        k = tl.load(
            k_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_ks
            + kv_head * stride_kh + cols[:, None],
            mask=key_ok[None, :] & col_ok[:, None], other=0,
        )
        if QUANTIZED:
            k = code_values(k, FP8).to(q.dtype)
            key_scale = tl.load(k_scales_ptr + block * num_kv_heads + kv_head, mask=key_ok, other=0.0)
            scores = tl.dot(q, k, input_precision=DOT_PRECISION) * (key_scale * scale_log2)[None, :]
        else:
            scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        allowed = (key_pos[None, :] <= query_pos[:, None]) & key_ok[None, :]
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row with nothing allowed yet keeps -inf; subtracting 0 instead avoids inf - inf.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - safe_max[:, None])
        alpha = tl.exp2(row_max - safe_max)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
            + kv_head * stride_vh + cols[None, :],
            mask=key_ok[:, None] & col_ok[None, :], other=0,
        )
        if QUANTIZED:
            v = code_values(v, FP8).to(q.dtype)
            p_v = p * tl.load(v_scales_ptr + block * num_kv_heads + kv_head, mask=key_ok, other=0.0)[None, :]
        else:
            p_v = p
        acc = acc * alpha[:, None] + tl.dot(p_v.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    out_mask = row_ok[:, None] & col_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(
            out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + cols[None, :],
            out.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:
        # Partials are [T, Hq, NUM_SPLITS] (+ [D] for the accumulator), contiguous.
        part = (q_row * num_q_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * head_dim + cols[None, :], acc, mask=out_mask)
        tl.store(part_max_ptr + part, row_max, mask=row_ok)
        tl.store(part_sum_ptr + part, row_sum, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    num_q_heads, head_dim, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    cols = tl.arange(0, HEAD_PAD)
    base = (token * num_q_heads + head) * NUM_SPLITS
    part_max = tl.load(part_max_ptr + base + splits, mask=split_ok, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + base + splits, mask=split_ok, other=0.0)
    overall = tl.max(part_max, axis=0)
    # Empty splits carry max -inf and sum 0: their weight is exp2(-inf) = 0.
    weight = tl.exp2(part_max - overall)
    denom = tl.sum(part_sum * weight, axis=0)
    acc = tl.load(
        part_acc_ptr + (base + splits)[:, None] * head_dim + cols[None, :],
        mask=split_ok[:, None] & (cols[None, :] < head_dim), other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / denom
    tl.store(out_ptr + token * stride_ot + head * stride_oh + cols, out.to(out_ptr.dtype.element_ty),
             mask=cols < head_dim)


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      tile_n: int, device: torch.device, multiprocessors: int | None = None) -> int:
    """Split only decode batches whose (sequence, KV head) pairs leave the GPU's SMs idle.

    A decode program keeps only a couple of key tiles in flight, so a few programs per SM are needed to
    cover memory latency; but splitting a batch that already has two per SM costs more in merging than it
    gains. Measured on an H200 (132 SMs; 8 KV heads of 128, bfloat16; bench/kernels_gpu.py's sweep): 512
    programs (64 x 2k) ran fastest unsplit, 136 us against 169 in 2 splits; 128 (16 x 4k) fastest in 8,
    91 us against 103 in 4 and 98 in 16; 8 (1 x 32k) in 32 or 64, 55 and 59 us.
    """
    if max_query_len != 1:
        return 1
    programs = num_seqs * num_kv_heads
    sms = _multiprocessors(device) if multiprocessors is None else multiprocessors
    if programs >= 2 * sms:
        return 1
    wanted = min(triton.next_power_of_2(triton.cdiv(PROGRAMS_PER_SM * sms, programs)), 64)
    # At least four key tiles per split, or the merge costs more than the parallelism gains; a power of
    # two bounds the number of compiled variants.
    max_useful = max(1, max_seq_len // (4 * tile_n))
    return min(wanted, 1 << (max_useful.bit_length() - 1))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q[T, Hq, D] -> out[T, Hq, D]; k_scales and v_scales [num_blocks, Hk] go with an int8 or fp8
    cache; num_splits forces the split-KV path (None: heuristic)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs caches with unit stride on the head dimension")
    check_scales(k_cache, v_cache, k_scales, v_scales)
    quantized = is_quantized(k_cache)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:   # read as bytes: kv_codes_triton.py makes their values
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    queries_per_kv = num_q_heads // num_kv_heads
    # Decode tiles are mostly padding rows, so keep them at tl.dot's minimum of 16 rows;
    # prefill tiles are larger to reuse each key tile across more queries.
    block_m = max(16 if max_query_len == 1 else 64, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    head_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n = 64 if head_pad <= 128 else 32
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_query_len, max_seq_len, tile_n, q.device)
    num_tiles = num_tokens // block_q + num_seqs
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused: NUM_SPLITS == 1 writes `out` directly

    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        part_acc, part_max, part_sum,
        k_scales if quantized else out, v_scales if quantized else out,   # unread unless QUANTIZED
        scale * LOG2E, num_seqs, num_q_heads, num_kv_heads, head_dim, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        HEAD_PAD=head_pad, NUM_SPLITS=num_splits, DOT_PRECISION=precision, QUANTIZED=quantized, FP8=fp8,
        # Decode tiles are small: a third pipeline stage keeps more key bytes in flight.
        num_warps=4, num_stages=3 if block_m <= 32 else 2,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_acc, part_max, part_sum, out, num_q_heads, head_dim, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_PAD=head_pad,
            num_warps=4,
        )
    return out
