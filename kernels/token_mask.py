"""A structured output's token mask applied to logits in place: token_mask.c on the CPU, xgrammar's
own kernel elsewhere (its CUDA and Triton ones on a GPU; its CPU one where the C kernels cannot run).
Both read xgrammar's bitmask layout (bit t % 32 of int32 word t / 32 set when token t is allowed) and
give refused tokens -inf, so which one ran never changes a sampled token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import cpu_native


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """logits[r, t] = -inf for every row r in `rows` and token t that bitmask[r] refuses."""
    if not rows:
        return
    words = (logits.shape[1] + 31) // 32
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[1] != words \
            or bitmask.shape[0] < logits.shape[0]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} {bitmask.dtype} does not cover logits {tuple(logits.shape)}")
    lib = cpu_native.library() if logits.device.type == "cpu" else None
    if lib is None or logits.dtype != torch.float32 or logits.stride(1) != 1 or not bitmask.is_contiguous():
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(rows))
        return
    ids = torch.tensor(list(rows), dtype=torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= logits.shape[0]:
        raise ValueError(f"rows {list(rows)} outside the logits' {logits.shape[0]}")
    lib.matinee_apply_token_bitmask(logits.data_ptr(), logits.stride(0), logits.shape[1], bitmask.data_ptr(),
                                    words, ids.data_ptr(), len(ids))
