"""SiLU-and-multiply as a Triton kernel over (row tile, column block) tiles.

Reference: activation.py. silu is computed in float32 and rounded before the multiply,
where torch rounds it.
"""

import torch
import triton
import triton.language as tl

from kernels.launch import as_rows, rows_per_program, warps_for

MAX_COLS = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, num_rows, inner,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
    mask = (rows < num_rows) & (cols < inner)
    gate = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + rows * stride_x + inner + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + rows * stride_out + cols, act * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inner = x.shape[-1] // 2
    rows = as_rows(x, 2 * inner)
    num_rows = rows.shape[0]
    out = torch.empty((num_rows, inner), dtype=x.dtype, device=x.device)
    if num_rows > 0:
        block_cols = min(MAX_COLS, triton.next_power_of_2(inner))
        block_rows = rows_per_program(block_cols)
        grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(inner, block_cols))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), num_rows, inner,
                                   BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
                                   num_warps=warps_for(block_rows * block_cols))
    return out.view(*x.shape[:-1], inner)
