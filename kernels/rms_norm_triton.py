"""RMSNorm and residual-add + RMSNorm as Triton kernels, one program per row.

Reference: rms_norm.py (same rounding order: normalise in float32, cast, scale by the weight).
"""

import torch
import triton
import triton.language as tl

from kernels.launch import as_rows, row_block, warps_for


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    stride_x, stride_res, stride_y, stride_res_out,
    width, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The add happens in the model dtype, as in the reference, before normalising.
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / width + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w * (xf * rstd).to(x.dtype)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


def _launch(x, residual, weight, eps):
    width = x.shape[-1]
    rows = as_rows(x, width)
    y = torch.empty_like(rows)
    res_rows = as_rows(residual, width) if residual is not None else rows
    res_out = torch.empty_like(rows) if residual is not None else y
    if rows.shape[0] > 0:
        block = row_block(width)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight, y, res_out,
            rows.stride(0), res_rows.stride(0), y.stride(0), res_out.stride(0),
            width, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps_for(block),
        )
    return y.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)
