"""The CPU's batched LoRA kernel (lora_sgmv.c) against the torch reference (kernels/lora.py): ranks 8, 16
and 64 in a fused group's stacks, float32 and bfloat16 rows and stacks, several slot layouts (an empty
segment, base-model rows between segments, one slot in two segments, segments of lengths that are not a
multiple of the kernel's tile, one-row segments of three slots in turn, which the kernel groups by slot), on
the AVX-512 build and the AVX2 one."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_native, lora_cpu
from kernels.lora import Layout, Segments, add_lora as reference

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no AVX2 CPU or no C compiler")

SLOTS, D_IN, WIDTHS = 5, 72, (40, 24, 24)   # a q|k|v group of three modules
LAYOUTS = {
    "decodes under many adapters": [(0, 2, 4), (2, 3, 0), (4, 6, 2), (6, 8, 1), (9, 11, 3)],
    "a long segment and a one-row one": [(3, 4, 2), (4, 40, 0), (43, 80, 2)],
    "an empty segment": [(0, 5, 1), (5, 5, 3), (7, 80, 3)],
    "arrival order, round robin": [(r, r + 1, r % 3) for r in range(0, 30) if r % 7] + [(30, 33, 1), (33, 34, 4)],
    "one slot for every row": [(0, 80, 1)],
}


def _stacks(max_rank: int, ranks: list[int], dtype: torch.dtype, seed: int, fill: float = 0.0):
    """A and B stacks with each slot's modules filled to its rank and `fill` everywhere else, and their layout."""
    g = torch.Generator().manual_seed(seed)
    a = torch.full((SLOTS, D_IN, len(WIDTHS) * max_rank), fill)
    b = torch.full((SLOTS, len(WIDTHS) * max_rank, sum(WIDTHS)), fill)
    blocks, column = [], 0
    for j, width in enumerate(WIDTHS):
        at = j * max_rank
        blocks.append((at, column, width))
        for slot, r in enumerate(ranks):
            a[slot, :, at:at + r] = torch.randn(D_IN, r, generator=g) * 0.3
            b[slot, at:at + r, column:column + width] = torch.randn(r, width, generator=g) * 0.3
        column += width
    return a.to(dtype), b.to(dtype), Layout(tuple(blocks), list(ranks))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:   # one bfloat16 rounding of the sum apart at most
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("rank,max_rank", [(8, 16), (16, 16), (64, 64)])
@pytest.mark.parametrize("act_dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                    (torch.bfloat16, torch.bfloat16)])
def test_kernel_matches_reference(layout_name, rank, max_rank, act_dtype, weight_dtype, each_build):
    segments = LAYOUTS[layout_name]
    ranks = [rank, max(1, rank // 2), rank, rank - 1, rank]   # slots 1 and 3: adapters of smaller ranks
    a, b, layout = _stacks(max_rank, ranks, weight_dtype, seed=rank)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(80, D_IN, generator=g).to(act_dtype)
    base = torch.randn(80, 150, generator=g).to(act_dtype)
    columns = slice(17, 17 + sum(WIDTHS))   # the group's output: a column slice of a wider projection
    want = base.to(torch.float32, copy=True)
    reference(want[:, columns], x.float(), a.float(), b.float(), segments)
    got = base.clone()
    lora_cpu.add_lora(got[:, columns], x, a, b, Segments(segments), layout)
    _close(got, want.to(act_dtype))
    touched = [r for s, e, _ in segments for r in range(s, e)]
    untouched = [r for r in range(80) if r not in touched]
    assert torch.equal(got[untouched], base[untouched])   # the base model's rows
    assert torch.equal(got[:, :17], base[:, :17]) and torch.equal(got[:, columns.stop:], base[:, columns.stop:])
    assert not torch.equal(got[touched], base[touched])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_reads_only_what_the_layout_says_may_be_non_zero(weight_dtype, each_build):
    """NaN wherever the layout says zero (the block diagonal's off-diagonal blocks, the columns past each
    slot's rank): the kernel never reads them, so its sums are the reference's on the zeroed stacks."""
    ranks = [16, 4, 9, 16, 1]
    zeroed = _stacks(16, ranks, weight_dtype, seed=1)
    poisoned = _stacks(16, ranks, weight_dtype, seed=1, fill=float("nan"))
    segments = LAYOUTS["decodes under many adapters"]
    x = torch.randn(12, D_IN, generator=torch.Generator().manual_seed(2))
    want, got = torch.zeros(12, sum(WIDTHS)), torch.zeros(12, sum(WIDTHS))
    reference(want, x, zeroed[0].float(), zeroed[1].float(), segments)
    lora_cpu.add_lora(got, x, poisoned[0], poisoned[1], Segments(segments), poisoned[2])
    _close(got, want)


def test_a_row_sums_the_same_alone_as_in_a_batch_and_on_any_thread_count(each_build):
    a, b, layout = _stacks(16, [16] * SLOTS, torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(4)
    x, base = torch.randn(80, D_IN, generator=g).bfloat16(), torch.randn(80, sum(WIDTHS), generator=g).bfloat16()
    together = base.clone()
    lora_cpu.add_lora(together, x, a, b, Segments(LAYOUTS["a long segment and a one-row one"]), layout)
    alone = base.clone()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        lora_cpu.add_lora(alone, x, a, b, Segments([(39, 40, 0)]), layout)   # the long segment's last row
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[39], together[39]) and not torch.equal(alone[39], base[39])


def test_what_the_kernel_does_not_take_goes_to_the_reference():
    a, b, layout = _stacks(16, [16] * SLOTS, torch.float32, seed=5)
    x, segments = torch.randn(6, D_IN, dtype=torch.float64), [(0, 6, 2)]
    got, want = torch.zeros(6, sum(WIDTHS), dtype=torch.float64), torch.zeros(6, sum(WIDTHS), dtype=torch.float64)
    assert not lora_cpu.takes(got, x, a, b)
    lora_cpu.add_lora(got, x, a, b, Segments(segments), layout)
    reference(want, x, a, b, segments)
    assert torch.equal(got, want)


def test_a_segment_outside_the_rows_or_the_slots_is_refused():
    a, b, layout = _stacks(16, [16] * SLOTS, torch.float32, seed=6)
    x, out = torch.randn(4, D_IN), torch.zeros(4, sum(WIDTHS))
    for bad in ([(2, 5, 0)], [(0, 2, SLOTS)]):
        with pytest.raises(IndexError):
            lora_cpu.add_lora(out, x, a, b, Segments(bad), layout)
