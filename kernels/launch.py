"""Small helpers the Triton launchers share: block sizes and warp counts from problem sizes."""

import triton


def row_block(width: int) -> int:
    """One power-of-two block covering a whole row (rows here are at most a few thousand wide)."""
    return triton.next_power_of_2(max(width, 1))


def warps_for(block_elems: int) -> int:
    # About 256 elements per warp keeps registers low while saturating loads on wide rows.
    return max(1, min(16, block_elems // 256))


def as_rows(x, width: int):
    """View x as [rows, width] with unit stride on the last dimension, copying only if needed."""
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows
