"""Small helpers the Triton launchers share: tile shapes and warp counts from problem sizes."""

import triton

# Elements one program handles in the row-wise kernels: wide rows get one row per program,
# narrow rows (a 64-wide head, a toy model) are packed several to a program, so a launch is
# never thousands of programs doing a few dozen elements each.
TILE_ELEMS = 4096


def rows_per_program(row_block: int, limit: int = 64) -> int:
    return max(1, min(limit, TILE_ELEMS // row_block))


def warps_for(tile_elems: int) -> int:
    # About 256 elements per warp keeps registers low while keeping loads wide.
    return max(1, min(16, tile_elems // 256))


def as_rows(x, width: int):
    """View x as [rows, width] with unit stride on the last dimension, copying only if needed."""
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows
