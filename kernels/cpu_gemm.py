"""Few-row float32 matmuls on the CPU (decode steps, speculative verification): cpu_gemm.c's launcher.

MKL's sgemm multiplies 2-24 rows by a weight matrix well below the memory bandwidth: on the
reference 2-core AMD EPYC (AVX2), SmolLM2's 30 layers and LM head take 170 ms for 8 rows where
cpu_gemm.c takes about 100, and 1 row 70 ms against 55. The reference is torch's x @ w.T.
"""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels.linear import linear as reference_linear

MAX_ROWS = 24     # above this MKL's blocked sgemm is as fast or faster


def matmul_nt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x[M, K] @ weight[N, K].T for float32 CPU tensors; needs `cpu_native.available()`."""
    lib = cpu_native.library()
    if lib is None:
        raise RuntimeError("the CPU C kernels are not available")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" \
            or weight.device.type != "cpu":
        raise ValueError("matmul_nt takes float32 CPU tensors")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul_nt shapes do not match: {tuple(x.shape)} @ {tuple(weight.shape)}.T")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    if out.numel():
        lib.matinee_sgemm_nt(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0],
                             x.shape[1], torch.get_num_threads())
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_rows: int | None = MAX_ROWS) -> torch.Tensor:
    """The model's projection on the CPU: this kernel for up to `max_rows` float32 rows (None: any number, as
    the batch-invariant kernels take every row through it), else the reference."""
    if 0 < x.shape[0] and (max_rows is None or x.shape[0] <= max_rows) and x.dtype == torch.float32 \
            and weight.dtype == torch.float32 and x.device.type == "cpu" and cpu_native.available():
        y = matmul_nt(x, weight)
        return y if bias is None else y.add_(bias)
    return reference_linear(x, weight, bias)
