"""Paged attention on the CPU: paged_attention_cpu.c's launcher for short query runs, SDPA per chunk.

Decode tokens and short speculative verifications read their context in place through the block
table, in float32 or bfloat16, from a cache of the same dtype or an int8 or fp8 one (kv_quant.py); the reference (paged_attention.py) gathers a padded copy
of every sequence's context and runs SDPA over it, which took 40% of a SmolLM2 decode step at
batch 7 (0.6k-token contexts) on the reference 2-core AMD EPYC. Longer runs (prefill chunks), where
SDPA's blocked kernel pays off, run it on their own context each, while the short runs of the same
batch stay in the kernel; other dtypes go to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels.kv_quant import check_scales, is_quantized
from kernels.paged_attention import paged_attention as reference_paged_attention

# Longer runs: the reference's blocked SDPA. With SmolLM2's heads and 0.6k-2k-token contexts the kernel
# took 0.65-1.07x the reference's time at 4 new tokens per sequence and 1.0-1.4x at 8 (either dtype;
# from an empty context it won up to ~128 tokens, but prefill chunks after a 1k-token past lost from 16).
MAX_QUERY_LEN = {torch.float32: 4, torch.bfloat16: 4}
_KERNELS = {torch.float32: "matinee_paged_attention", torch.bfloat16: "matinee_paged_attention_bf16"}


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q[T, Hq, D] -> out[T, Hq, D]; the kernels contract of paged_attention.py."""
    lib = cpu_native.library()
    check_scales(k_cache, v_cache, k_scales, v_scales)
    quantized = is_quantized(k_cache)
    if (lib is None or q.dtype not in _KERNELS or (k_cache.dtype != q.dtype and not quantized)
            or q.device.type != "cpu"):
        return _reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                          scale, k_scales, v_scales)
    if max_query_len > MAX_QUERY_LEN[q.dtype]:
        return _mixed(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales, v_scales)
    return _kernel(lib, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales, v_scales)


def _reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale,
               k_scales, v_scales) -> torch.Tensor:
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        # torch's CPU SDPA runs float32 faster than bf16: SmolLM2's heads, 4 x 287-token chunks,
        # 6.5 ms a layer against 9.8 (the gathered context is widened as it is copied anyway).
        return reference_paged_attention(q.float(), k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                         max_query_len, max_seq_len, scale, k_scales, v_scales).to(torch.bfloat16)
    return reference_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     max_query_len, max_seq_len, scale, k_scales, v_scales)


def _mixed(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales, v_scales) -> torch.Tensor:
    """A batch with prefill chunks: the short query runs (decodes, verifications) go through the
    kernel together, each chunk through SDPA on its own context alone. The reference pads every
    chunk to the longest and gathers every context to the longest sequence; in a step of 4 fresh
    256-token prompts and 24 decodes it took 15 ms a layer, the decodes 3 ms of it (0.5 in the kernel)."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    if len(starts) != len(lens) + 1 or block_tables.shape[0] != len(lens) or starts[-1] != q.shape[0]:
        raise ValueError("paged_attention: block tables, query_start_loc and seq_lens disagree")
    limit = MAX_QUERY_LEN[q.dtype]
    short = [b for b in range(len(lens)) if starts[b + 1] - starts[b] <= limit]
    out = torch.empty_like(q)
    if short:
        rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in short])
        q_lens = torch.tensor([0] + [starts[b + 1] - starts[b] for b in short])
        picked = torch.tensor(short)
        out[rows] = _kernel(cpu_native.library(), q[rows], k_cache, v_cache, block_tables[picked], seq_lens[picked],
                            torch.cumsum(q_lens, 0).to(torch.int32), scale, k_scales, v_scales)
    for b in range(len(lens)):
        first, end = starts[b], starts[b + 1]
        if end - first <= limit:
            continue
        if is_quantized(k_cache):   # the reference dequantizes the blocks as it gathers them
            out[first:end] = _reference(q[first:end], k_cache, v_cache, block_tables[b:b + 1], seq_lens[b:b + 1],
                                        torch.tensor([0, end - first], dtype=torch.int32), end - first, lens[b],
                                        scale, k_scales, v_scales)
        else:
            out[first:end] = _chunk(q[first:end], k_cache, v_cache, block_tables[b], lens[b], scale)
    return out


def _chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, seq_len: int,
           scale: float) -> torch.Tensor:
    """One sequence's chunk q[n, Hq, D], the last n of its seq_len positions, in float32 SDPA (faster
    than bf16 on the CPU); a chunk that is the whole sequence (a fresh prompt) needs no mask."""
    n, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    ids = table[:(seq_len + block_size - 1) // block_size].long()
    if n > seq_len or ids.shape[0] * block_size < seq_len:
        raise ValueError("paged_attention: block tables, query_start_loc and seq_lens disagree")
    if int(ids.min()) < 0 or int(ids.max()) >= k_cache.shape[0]:
        raise ValueError("paged_attention: a block id out of range")

    def context(cache: torch.Tensor) -> torch.Tensor:   # [1, Hk, seq_len, D], float32
        return cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)[None].float()

    keys, values = context(k_cache), context(v_cache)
    query = q.transpose(0, 1)[None].float()
    mask = None
    if n != seq_len:   # query i sits at position seq_len - n + i
        mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=num_q_heads != num_kv_heads)
    return out[0].transpose(0, 1).to(q.dtype)


def _kernel(lib, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales,
            v_scales) -> torch.Tensor:
    """Short query runs through paged_attention_cpu.c, reading the context in place."""
    quantized = is_quantized(k_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"K/V caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit queries "
                         f"of head_dim {head_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention needs contiguous K/V caches")
    batch = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if tables.shape[0] != batch or starts.shape[0] != batch + 1:
        raise ValueError("paged_attention: block tables, query_start_loc and seq_lens disagree")
    # The kernel checks the rest of the metadata it follows (ranges, lengths, block ids) itself:
    # here that took ~30 small torch ops per layer, 4 ms of a 90 ms decode step.
    if quantized:
        status = lib.matinee_paged_attention_quant(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scales.data_ptr(), v_scales.data_ptr(),
            tables.data_ptr(), starts.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, num_tokens, num_q_heads,
            num_kv_heads, head_dim, block_size, tables.shape[1], k_cache.shape[0], scale, torch.get_num_threads(),
            int(q.dtype == torch.bfloat16), int(k_cache.dtype == torch.float8_e4m3fn))
    else:
        status = getattr(lib, _KERNELS[q.dtype])(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), starts.data_ptr(),
            lens.data_ptr(), out.data_ptr(), batch, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size,
            tables.shape[1], k_cache.shape[0], scale, torch.get_num_threads())
    if status == -2:
        raise ValueError("paged_attention: block tables, query_start_loc and seq_lens disagree")
    if status == -3:
        raise ValueError("paged_attention: a block id out of range")
    if status != 0:
        raise MemoryError("paged_attention: no memory for the scores of a sequence")
    return out
