"""Rotary embedding (neox layout) as a Triton kernel: one program per token rotates all its
query and key heads with one load of the cos/sin row. Reference: rope.py."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, stride_t, stride_h, dst_stride_t, dst_stride_h, token,
                  num_heads, half, cos, sin, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < half)
    src = src_ptr + token * stride_t + heads * stride_h + cols
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    dst = dst_ptr + token * dst_stride_t + heads * dst_stride_h + cols
    tl.store(dst, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(dst + half, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    num_q_heads, num_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < half
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=cmask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + half + cols, mask=cmask, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token,
                  num_q_heads, half, cos, sin, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token,
                  num_k_heads, half, cos, sin, BLOCK_HK, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens > 0:
        half = head_dim // 2
        _rope_kernel[(num_tokens,)](
            positions, q, k, cache, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            num_q_heads, num_k_heads, half,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_k_heads),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )
    return q_out, k_out
