"""Batched LoRA: the extra `x @ A @ B` of every sequence's adapter, added to a projection's output.

The batch's rows come grouped by adapter: `segments` are (start, end, slot) runs of rows that share
the adapter in pool slot `slot` (punica's SGMV, S-LoRA's layout), and `a` / `b` are the pool's
stacked A [slots, in, rank] and B [slots, rank, out] (B already scaled). Rows of no segment (the base
model's requests) are left alone; the base projection itself is never touched, so any weight
format (GGUF blocks, int8, int4) takes an adapter the same way. This file is the torch reference;
lora_triton.py is the same on the GPU.
"""
from __future__ import annotations

import torch

Segment = tuple[int, int, int]   # rows [start, end) read the adapter in slot `slot`


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             segments: list[Segment]) -> None:
    """out[start:end] += x[start:end] @ a[slot] @ b[slot] for each segment, in place (`out` may be
    a column slice of a fused projection's output)."""
    x = x.to(a.dtype)   # the stacks may be float32 under a bfloat16 model (see LoRASlots)
    for start, end, slot in segments:
        out[start:end] += (x[start:end] @ a[slot]) @ b[slot]
