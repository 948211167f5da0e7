"""Writing new K/V rows into the paged cache as a Triton kernel, one program per token.

Reference: kv_write.py. Offsets are computed in int64: block_id * block stride overflows
int32 on caches of a few GiB.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    num_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    # A negative slot (padding) masks every lane instead of branching. The slot is broadcast
    # to a tensor first: the interpreter rejects a mask and-ed with a scalar condition.
    mask = (heads < num_heads) & (cols < head_dim) & (heads * 0 + slot >= 0)
    block = slot // block_size
    offset = slot % block_size
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + cols, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + cols, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + heads * stride_kc_head + cols
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + heads * stride_vc_head + cols
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv needs caches with unit stride on the head dimension")
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, head_dim, k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
    )
