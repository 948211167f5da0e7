"""Paged attention on the CPU for short query runs: paged_attention_cpu.c's launcher.

Decode tokens and short speculative verifications read their context in place through the block
table, in float32 or bfloat16, from a cache of the same dtype or an int8 or fp8 one (kv_quant.py); the reference (paged_attention.py) gathers a padded copy
of every sequence's context and runs SDPA over it, which took 40% of a SmolLM2 decode step at
batch 7 (0.6k-token contexts) on the reference 2-core AMD EPYC. Longer runs, where SDPA's blocked
kernel pays off, and other dtypes go to the reference.
"""

from __future__ import annotations

import torch

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
            or max_query_len > MAX_QUERY_LEN[q.dtype] or q.device.type != "cpu"):
        if q.dtype == torch.bfloat16 and q.device.type == "cpu":
            # torch's CPU SDPA runs float32 faster than bf16: SmolLM2's heads, 4 x 287-token chunks,
            # 6.5 ms a layer against 9.8 (the gathered context is widened as it is copied anyway).
            return reference_paged_attention(q.float(), k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                             max_query_len, max_seq_len, scale, k_scales,
                                             v_scales).to(torch.bfloat16)
        return reference_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                         max_query_len, max_seq_len, scale, k_scales, v_scales)
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
