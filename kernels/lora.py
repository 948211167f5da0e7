"""Batched LoRA: the extra `x @ A @ B` of every sequence's adapter, added to a projection's output.

The batch's rows come grouped by adapter: `segments` are (start, end, slot) runs of rows that share
the adapter in pool slot `slot` (punica's SGMV, S-LoRA's layout), and `a` / `b` are the pool's
stacked A [slots, in, rank] and B [slots, rank, out] (B already scaled). Rows of no segment (the base
model's requests) are left alone; the base projection itself is never touched, so any weight
format (GGUF blocks, int8, int4) takes an adapter the same way. This file is the torch reference;
lora_triton.py is the same on the GPU, lora_cpu.py (lora_sgmv.c) on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Segment = tuple[int, int, int]   # rows [start, end) read the adapter in slot `slot`


@dataclass(frozen=True)
class Layout:
    """Where a group's stacks may be non-zero, for a kernel that skips the rest (the sums are the same):
    per module, `blocks` (its rank columns' start in A / rows' in B, its output columns' start, its width),
    and per slot, `ranks` (how many of each module's rank columns the adapter there fills; the pool updates
    the list as it loads adapters)."""
    blocks: tuple[tuple[int, int, int], ...]
    ranks: list[int]


class Segments(list):
    """A step's segments, with the index tensors of `_padded_bmm` made once for all its layers."""

    def padded(self, num_slots: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(rows, slot of each row, position of each row within its segment, the longest segment)."""
        cached = getattr(self, "_padded", None)
        if cached is None:
            rows = [r for s, e, _ in self for r in range(s, e)]
            slots = [slot for s, e, slot in self for _ in range(s, e)]
            pos = [r - s for s, e, _ in self for r in range(s, e)]
            as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)   # noqa: E731
            cached = self._padded = (as_tensor(rows), as_tensor(slots), as_tensor(pos),
                                     max(e - s for s, e, _ in self))
        return cached


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             segments: list[Segment], layout: Layout | None = None) -> None:
    """out[start:end] += x[start:end] @ a[slot] @ b[slot] for each segment, in place (`out` may be
    a column slice of a fused projection's output). Many short segments (decodes under many adapters)
    go as two batched matmuls over every slot; a few long ones, one pair of matmuls each. `layout` is
    only a hint where the stacks are zero: this reference reads them whole."""
    if not segments:
        return
    x = x.to(a.dtype)   # the stacks may be float32 under a bfloat16 model (see LoRASlots)
    longest = max(e - s for s, e, _ in segments)
    if isinstance(segments, Segments) and len(segments) > 2 and a.shape[0] * longest <= 2 * x.shape[0]:
        _padded_bmm(out, x, a, b, segments)
        return
    for start, end, slot in segments:
        out[start:end] += (x[start:end] @ a[slot]) @ b[slot]


def _padded_bmm(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: Segments) -> None:
    """Every slot's rows padded to the longest segment, [slots, longest, in], through the whole stacks
    at once: a handful of calls instead of two matmuls a segment (each costs ~10 us of dispatch on a
    CPU, where a 2-row segment's arithmetic is less). Unused slots compute on zeros."""
    rows, slots, pos, longest = segments.padded(a.shape[0], x.device)
    padded = x.new_zeros(a.shape[0], longest, x.shape[1])
    padded[slots, pos] = x[rows]
    delta = torch.bmm(torch.bmm(padded, a), b)
    out[rows] += delta[slots, pos].to(out.dtype)


def segment_table(segments: list[Segment], layout: Layout | None, rank: int, rows: int, slots: int) -> torch.Tensor:
    """The C kernels' table of a step's segments: int64 [segments, 4] (start, end, slot, the adapter's rank),
    checked against the step's `rows` and the pool's `slots`, and made once a step for a step's Segments: every
    layer reads the same."""
    cached = getattr(segments, "_sgmv", None)
    if cached is None:
        if any(not (0 <= s <= e <= rows and 0 <= slot < slots) for s, e, slot in segments):
            raise IndexError(f"add_lora: a segment outside {rows} rows or {slots} slots: {list(segments)}")
        cached = torch.tensor([(s, e, slot, rank if layout is None else layout.ranks[slot])
                               for s, e, slot in segments], dtype=torch.int64).reshape(-1, 4)
        if isinstance(segments, Segments):
            segments._sgmv = cached
    return cached


def block_table(layout: Layout | None, rank: int, width: int) -> torch.Tensor:
    """The C kernels' table of a group's modules: int64 [modules, 3] (rank_at, out_at, width); without a
    layout one module over the whole stacks."""
    if layout is None:
        return torch.tensor([[0, 0, width]], dtype=torch.int64)
    cached = getattr(layout, "_sgmv", None)
    if cached is None:
        cached = torch.tensor(layout.blocks, dtype=torch.int64).reshape(-1, 3)
        object.__setattr__(layout, "_sgmv", cached)   # frozen: the table is a cache of what it says
    return cached
