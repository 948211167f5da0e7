"""SiLU-and-multiply as a Triton kernel: a 2D grid over (token, column block).

Reference: activation.py. silu is computed in float32 and rounded before the multiply,
where torch rounds it.
"""

import torch
import triton
import triton.language as tl

from kernels.launch import as_rows

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, act * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inner = x.shape[-1] // 2
    rows = as_rows(x, 2 * inner)
    out = torch.empty((rows.shape[0], inner), dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0:
        block = min(BLOCK, triton.next_power_of_2(inner))
        grid = (rows.shape[0], triton.cdiv(inner, block))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), inner, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], inner)
