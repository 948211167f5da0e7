"""Rotary embedding (neox layout) as a Triton kernel over tiles of (token, head) rows.

Each row gathers its token's cos/sin row from the cache; q and k are two launches of the
same kernel. Reference: rope.py.
"""

import torch
import triton
import triton.language as tl

from kernels.launch import rows_per_program, warps_for


@triton.jit
def _rope_kernel(
    pos_ptr, x_ptr, out_ptr, cache_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cache,
    num_rows, num_heads, half,
    BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    token = (rows // num_heads).to(tl.int64)[:, None]
    head = (rows % num_heads)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = row_ok[:, None] & (cols < half)
    pos = tl.load(pos_ptr + token, mask=row_ok[:, None], other=0).to(tl.int64)
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=mask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + half + cols, mask=mask, other=0.0)
    src = x_ptr + token * stride_xt + head * stride_xh + cols
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    dst = out_ptr + token * stride_ot + head * stride_oh + cols
    tl.store(dst, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(dst + half, (b * cos + a * sin).to(x1.dtype), mask=mask)


def _rotate(positions, x, cache):
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    num_rows = num_tokens * num_heads
    if num_rows > 0:
        half = head_dim // 2
        block_half = triton.next_power_of_2(half)
        block_rows = rows_per_program(block_half)
        _rope_kernel[(triton.cdiv(num_rows, block_rows),)](
            positions, x, out, cache,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cache.stride(0),
            num_rows, num_heads, half,
            BLOCK_ROWS=block_rows, BLOCK_HALF=block_half, num_warps=warps_for(block_rows * block_half),
        )
    return out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    return _rotate(positions, q, cache), _rotate(positions, k, cache)
