"""Batched LoRA on the CPU: lora_sgmv.c's launcher, one C call for all of a step's segments.

Takes float32 or bfloat16 rows and float32 or bfloat16 stacks (the pool holds them in the model dtype
under these kernels: half the bytes a decode step reads in bfloat16); anything else (another dtype, a
layout the kernel does not take, no C kernels) goes to lora.py's reference, which computes the same sums.
"""
from __future__ import annotations

import torch

from kernels import cpu_native, lora
from kernels.lora import Layout, Segment, block_table, segment_table

_DTYPES = (torch.float32, torch.bfloat16)


def takes(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether lora_sgmv.c computes this call (else the reference does)."""
    return (x.dtype == out.dtype and x.dtype in _DTYPES and a.dtype == b.dtype and a.dtype in _DTYPES
            and all(t.device.type == "cpu" for t in (out, x, a, b)) and x.dim() == out.dim() == 2
            and x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
            and a.dim() == b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]
            and x.shape[1] == a.shape[1] and out.shape[1] == b.shape[2] and x.shape[0] == out.shape[0]
            and cpu_native.library() is not None)


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             segments: list[Segment], layout: Layout | None = None) -> None:
    """As lora.add_lora: out[start:end] += x[start:end] @ a[slot] @ b[slot] per segment, in place, reading
    only what `layout` says may be non-zero."""
    if not segments:
        return
    if not takes(out, x, a, b):
        lora.add_lora(out, x, a, b, segments, layout)
        return
    table = segment_table(segments, layout, a.shape[2], x.shape[0], a.shape[0])
    blocks = block_table(layout, a.shape[2], b.shape[2])
    status = cpu_native.library().matinee_lora_add(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), int(x.dtype == torch.bfloat16), a.data_ptr(),
        b.data_ptr(), int(a.dtype == torch.bfloat16), a.shape[1], a.shape[2], b.shape[2], table.data_ptr(),
        table.shape[0], blocks.data_ptr(), blocks.shape[0], torch.get_num_threads())
    if status:
        raise MemoryError("add_lora: no memory for the rows' scratch")
