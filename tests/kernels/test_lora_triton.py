"""The batched LoRA kernel against its torch reference on odd shapes: segments of 1 to 37 rows,
ranks 1 to 24 padded into a stack of 32, base-model rows between segments left alone, and the
output a column slice of a wider fused projection (Triton's interpreter without a GPU)."""
from __future__ import annotations

import os

import pytest
import torch

from kernels.lora import add_lora as reference

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton_lora = pytest.importorskip("kernels.lora_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("rank", [1, 8, 24])
def test_kernel_matches_reference(dtype, tol, rank):
    g = torch.Generator().manual_seed(rank)
    slots, max_rank, d_in, d_out, width = 3, 32, 72, 50, 130
    a = torch.zeros(slots, d_in, max_rank)
    b = torch.zeros(slots, max_rank, d_out)
    a[:, :, :rank] = torch.randn(slots, d_in, rank, generator=g) * 0.3
    b[:, :rank] = torch.randn(slots, rank, d_out, generator=g) * 0.3
    x = torch.randn(80, d_in, generator=g)
    base = torch.randn(80, width, generator=g)
    # Rows 0-2 and 40-42 are the base model's; a slot appears in two segments.
    segments = [(3, 4, 2), (4, 41 - 1, 0), (43, 80, 2)]
    want = base.clone()
    reference(want[:, 17:17 + d_out], x, a, b, segments)
    to = dict(device=DEVICE, dtype=dtype)
    got = base.to(**to)
    triton_lora.add_lora(got[:, 17:17 + d_out], x.to(**to), a.to(**to), b.to(**to), segments)
    assert torch.allclose(got.float().cpu(), want, atol=tol, rtol=tol)
    assert torch.equal(got[:3].float().cpu(), base[:3].to(dtype).float())    # base rows untouched
    assert torch.equal(got[:, :17].float().cpu(), base[:, :17].to(dtype).float())   # other columns too
