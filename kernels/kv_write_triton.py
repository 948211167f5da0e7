"""Writing new K/V rows into the paged cache as a Triton kernel over tiles of tokens.

Reference: kv_write.py. A token's heads are written as one row of Hk * D elements, which
needs each token's heads contiguous in the input and in a cache slot (true of the model's
projections and of the runner's caches). Offsets are computed in int64: block_id times the
block stride overflows int32 on caches of a few GiB.

An int8 or fp8 cache follows kv_quant.py's rule, which is sequential within a block: one program per
(block written by this call, KV head) takes that block's tokens in order. fp8 codes are made and read
with integer ops (kv_codes_triton.py), bit for bit as torch's casts, on any device and under the
interpreter alike. Its divisions are tl.math.div_rn: a plain `/` compiles to the GPU's approximate
division (div.full.f32, up to 2 ulp off), and a code or scale one ulp off is not torch's.
"""

import torch
import triton
import triton.language as tl

from kernels.kv_codes_triton import code_values, quantize_values
from kernels.kv_quant import QMAX, check_scales, is_quantized
from kernels.launch import rows_per_program, warps_for


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_vt, stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot,
    num_tokens, width, block_size,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    token_ok = tokens < num_tokens
    slot = tl.load(slot_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)[None, :]
    # A negative slot (padding) writes nothing.
    mask = (slot >= 0)[:, None] & (cols < width)
    block = (slot // block_size)[:, None]
    offset = (slot % block_size)[:, None]
    k = tl.load(k_ptr + tokens[:, None] * stride_kt + cols, mask=mask)
    v = tl.load(v_ptr + tokens[:, None] * stride_vt + cols, mask=mask)
    tl.store(k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + cols,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + cols,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_quantized_kernel(
    x_ptr, cache_ptr, scale_ptr, slot_ptr, order_ptr, group_start_ptr,
    stride_xt, stride_cb, stride_cs, block_size, num_kv_heads, head_dim,
    QMAX: tl.constexpr, FP8: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    group = tl.program_id(0)
    head = tl.program_id(1)
    lo = tl.load(group_start_ptr + group)
    hi = tl.load(group_start_ptr + group + 1)
    cols = tl.arange(0, HEAD_PAD)
    col_ok = cols < head_dim
    rows = tl.arange(0, BLOCK_S)
    for i in range(lo, hi):
        token = tl.load(order_ptr + i).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        block = slot // block_size
        offset = slot % block_size
        head_base = cache_ptr + block * stride_cb + head * head_dim
        x = tl.load(x_ptr + token * stride_xt + head * head_dim + cols, mask=col_ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale_at = scale_ptr + block * num_kv_heads + head
        old = tl.where(offset == 0, 0.0, tl.load(scale_at))
        grows = amax > old * QMAX
        new = tl.where(grows, tl.math.div_rn(amax, QMAX), old)
        if grows & (old > 0.0):   # the block's tokens before this one move to the new scale
            held_at = head_base + rows[:, None] * stride_cs + cols[None, :]
            held_mask = (rows < offset)[:, None] & col_ok[None, :]
            held = code_values(tl.load(held_at, mask=held_mask, other=0), FP8) * tl.math.div_rn(old, new)
            tl.store(held_at, quantize_values(held, QMAX, FP8), mask=held_mask)
        tl.store(scale_at, new)
        divisor = tl.where(new > 0.0, new, 1.0)
        tl.store(head_base + offset * stride_cs + cols, quantize_values(tl.math.div_rn(x, divisor), QMAX, FP8), mask=col_ok)
        tl.debug_barrier()   # the next token may read back this block


def _write_kv_quantized(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales) -> None:
    check_scales(k_cache, v_cache, k_scales, v_scales)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv needs contiguous K/V caches")
    num_tokens, num_heads, head_dim = k.shape
    slots = slot_mapping.long()
    tokens = (slots >= 0).nonzero().squeeze(1)
    if tokens.numel() == 0:
        return
    # The tokens of each block, in call order, as one group.
    blocks = slots[tokens] // k_cache.shape[1]
    by_block = torch.sort(blocks, stable=True).indices
    order = tokens[by_block]
    _, counts = torch.unique_consecutive(blocks[by_block], return_counts=True)
    group_start = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=k.device)
    group_start[1:] = torch.cumsum(counts, 0)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        if not _heads_contiguous(x, head_dim, 2):
            x = x.contiguous()
        codes = cache.view(torch.uint8) if fp8 else cache
        _write_kv_quantized_kernel[(counts.numel(), num_heads)](
            x, codes, scales, slots, order, group_start,
            x.stride(0), cache.stride(0), cache.stride(1), cache.shape[1], num_heads, head_dim,
            QMAX=QMAX[cache.dtype], FP8=fp8, BLOCK_S=triton.next_power_of_2(cache.shape[1]),
            HEAD_PAD=triton.next_power_of_2(head_dim), num_warps=1,
        )


def _heads_contiguous(t: torch.Tensor, head_dim: int, head_dim_index: int) -> bool:
    return t.stride(head_dim_index) == 1 and t.stride(head_dim_index - 1) == head_dim


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if is_quantized(k_cache) or is_quantized(v_cache):
        return _write_kv_quantized(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    if not _heads_contiguous(k, head_dim, 2):
        k = k.contiguous()
    if not _heads_contiguous(v, head_dim, 2):
        v = v.contiguous()
    if not (_heads_contiguous(k_cache, head_dim, 3) and _heads_contiguous(v_cache, head_dim, 3)):
        raise ValueError("write_kv needs caches whose slots hold [Hk, D] contiguously")
    width = num_heads * head_dim
    block_w = triton.next_power_of_2(width)
    block_t = rows_per_program(block_w)
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        num_tokens, width, k_cache.shape[1],
        BLOCK_T=block_t, BLOCK_W=block_w, num_warps=warps_for(block_t * block_w),
    )
