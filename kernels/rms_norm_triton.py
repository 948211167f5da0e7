"""RMSNorm and residual-add + RMSNorm as Triton kernels over tiles of whole rows.

Reference: rms_norm.py (same rounding order: normalise in float32, cast, scale by the weight).
"""

import torch
import triton
import triton.language as tl

from kernels.launch import as_rows, rows_per_program, warps_for


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    stride_x, stride_res, stride_y, stride_res_out,
    num_rows, width, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < width)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The add happens in the model dtype, as in the reference, before normalising.
        x = x + tl.load(res_ptr + rows * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + rows * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / width + eps)
    w = tl.load(w_ptr + cols, mask=cols < width, other=0.0)
    y = w * (xf * rstd[:, None]).to(x.dtype)
    tl.store(y_ptr + rows * stride_y + cols, y, mask=mask)


def _launch(x, residual, weight, eps):
    width = x.shape[-1]
    rows = as_rows(x, width)
    num_rows = rows.shape[0]
    y = torch.empty((num_rows, width), dtype=x.dtype, device=x.device)
    res_rows = as_rows(residual, width) if residual is not None else rows
    res_out = torch.empty_like(y) if residual is not None else y
    if num_rows > 0:
        block = triton.next_power_of_2(width)
        block_rows = rows_per_program(block)
        _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            rows, res_rows, weight, y, res_out,
            rows.stride(0), res_rows.stride(0), y.stride(0), res_out.stride(0),
            num_rows, width, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK=block,
            num_warps=warps_for(block_rows * block),
        )
    return y.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)
