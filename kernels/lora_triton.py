"""Batched LoRA on the GPU: SGMV as two Triton kernels, shrink (x @ A into a float32 buffer of
`rank` columns) then expand (that @ B added into the output), one program per (segment, row
block, column block), each reading its segment's adapter slot.

Reference: lora.py (same arithmetic; the rank-wide intermediate is kept in float32 here).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora import Segment, Segments

BLOCK_M, BLOCK_K, BLOCK_N = 16, 32, 32


@triton.jit
def _segment_rows(seg_start_ptr, seg_len_ptr, seg, row_block, BLOCK_M: tl.constexpr):
    """Row block `row_block` of segment `seg`: the rows' indices in the batch, and which of them exist."""
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    return (tl.load(seg_start_ptr + seg) + rows).to(tl.int64), rows < tl.load(seg_len_ptr + seg)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, t_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                   stride_x, stride_a_slot, stride_a_in, stride_t, d_in, rank,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    seg, row_block = tl.program_id(0), tl.program_id(1)
    if row_block * BLOCK_M >= tl.load(seg_len_ptr + seg):
        return
    rows, row_ok = _segment_rows(seg_start_ptr, seg_len_ptr, seg, row_block, BLOCK_M)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    cols_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < d_in),
                    other=0.0)
        a = tl.load(a_ptr + slot * stride_a_slot + ks[:, None] * stride_a_in + cols_r[None, :],
                    mask=(ks[:, None] < d_in) & (cols_r[None, :] < rank), other=0.0)
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    tl.store(t_ptr + rows[:, None] * stride_t + cols_r[None, :], acc,
             mask=row_ok[:, None] & (cols_r[None, :] < rank))


@triton.jit
def _expand_kernel(t_ptr, b_ptr, out_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                   stride_t, stride_b_slot, stride_b_r, stride_out, d_out, rank,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg, row_block, col_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if row_block * BLOCK_M >= tl.load(seg_len_ptr + seg):
        return
    rows, row_ok = _segment_rows(seg_start_ptr, seg_len_ptr, seg, row_block, BLOCK_M)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    t = tl.load(t_ptr + rows[:, None] * stride_t + rs[None, :], mask=row_ok[:, None] & (rs[None, :] < rank),
                other=0.0)
    b = tl.load(b_ptr + slot * stride_b_slot + rs[:, None] * stride_b_r + cols[None, :],
                mask=(rs[:, None] < rank) & (cols[None, :] < d_out), other=0.0)
    delta = tl.dot(t, b.to(tl.float32))
    mask = row_ok[:, None] & (cols[None, :] < d_out)
    out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(out, (tl.load(out, mask=mask, other=0.0).to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _segment_table(segments: list[Segment], device: torch.device) -> tuple[torch.Tensor, int]:
    """[3, segments] int32 on the device (starts, lengths, slots) and the longest segment; made once a step
    for a step's Segments (every layer reads the same), not once a call."""
    cached = getattr(segments, "_table", None)
    if cached is None:
        starts, ends, slots = zip(*segments)
        lengths = [e - s for s, e in zip(starts, ends)]
        cached = torch.tensor([starts, lengths, slots], dtype=torch.int32, device=device), max(lengths)
        if isinstance(segments, Segments):
            segments._table = cached
    return cached


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             segments: list[Segment], layout=None) -> None:
    """As lora.add_lora: out[start:end] += x[start:end] @ a[slot] @ b[slot] per segment, in place
    (the stacks read whole: `layout` is not used here)."""
    if not segments:
        return
    rank, d_in, d_out = a.shape[2], a.shape[1], b.shape[2]
    if x.stride(-1) != 1 or out.stride(-1) != 1 or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError("add_lora wants unit-stride rows and contiguous A and B stacks")
    meta, longest = _segment_table(segments, x.device)
    t = torch.empty(x.shape[0], rank, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(rank))
    rows = triton.cdiv(longest, BLOCK_M)
    _shrink_kernel[(len(segments), rows)](
        x, a, t, meta[0], meta[1], meta[2], x.stride(0), a.stride(0), a.stride(1), t.stride(0), d_in, rank,
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=block_r)
    _expand_kernel[(len(segments), rows, triton.cdiv(d_out, BLOCK_N))](
        t, b, out, meta[0], meta[1], meta[2], t.stride(0), b.stride(0), b.stride(1), out.stride(0), d_out, rank,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r)
