"""Writing new K/V rows into the paged cache as a Triton kernel over tiles of tokens.

Reference: kv_write.py. A token's heads are written as one row of Hk * D elements, which
needs each token's heads contiguous in the input and in a cache slot (true of the model's
projections and of the runner's caches). Offsets are computed in int64: block_id times the
block stride overflows int32 on caches of a few GiB.
"""

import torch
import triton
import triton.language as tl

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


def _heads_contiguous(t: torch.Tensor, head_dim: int, head_dim_index: int) -> bool:
    return t.stride(head_dim_index) == 1 and t.stride(head_dim_index - 1) == head_dim


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
