"""The batched LoRA kernel against its torch reference on odd shapes: segments of 1 to 37 rows,
ranks 1 to 24 padded into a stack of 32, base-model rows between segments left alone, and the
output a column slice of a wider fused projection; then a tiny model with an adapter on the Triton
kernels against the torch ones (Triton's interpreter without a GPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.lora import Segments, add_lora as reference
from tests.kernels.conftest import DEVICE

triton_lora = pytest.importorskip("kernels.lora_triton")


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
    table = Segments(segments)   # its device table made at the first call, read again at the second
    triton_lora.add_lora(got[:, 17:17 + d_out], x.to(**to), a.to(**to), b.to(**to), table)
    assert table._table[1] == 37
    assert torch.allclose(got.float().cpu(), want, atol=tol, rtol=tol)
    assert torch.equal(got[:3].float().cpu(), base[:3].to(dtype).float())    # base rows untouched
    assert torch.equal(got[:, :17].float().cpu(), base[:, :17].to(dtype).float())   # other columns too


def test_a_model_with_an_adapter_on_triton_kernels_matches_torch(tmp_path):
    from actors.worker.forward_batch import ForwardBatch, SequenceInput
    from actors.worker.lora_adapter import read_adapter
    from actors.worker.model_runner import ModelRunner
    from tests.actors.conftest import build_tiny_model
    from tests.actors.lora_adapters import make_adapter

    base = build_tiny_model("qwen2", str(tmp_path / "base"))
    folder = make_adapter(base, str(tmp_path / "lora"), "mlp")
    runners = [ModelRunner(base, dtype="float32", kernels=k, device=DEVICE, block_size=8, num_blocks=16,
                           num_threads=1, max_loras=2, max_lora_rank=16) for k in ("triton", "torch")]
    adapter = read_adapter("mlp", folder, runners[0].model_config, 16)
    # A prompt with the adapter, one without, then a decode of each: segments of 11 rows and of 1.
    batch = ForwardBatch([SequenceInput(list(range(5, 16)), 0, [0, 1], 11, adapter=adapter),
                          SequenceInput([7, 8, 9], 0, [2], 3)])
    step = ForwardBatch([SequenceInput([3], 11, [0, 1], adapter=adapter), SequenceInput([4], 3, [2])])
    for b in (batch, step):
        got, want = (r.execute(b) for r in runners)
        assert torch.allclose(got.cpu(), want.cpu(), atol=1e-3, rtol=1e-3)


def test_the_reference_batched_over_slots_equals_it_segment_by_segment():
    """Many short segments (decodes under many adapters) take the padded batched path: the same sums."""
    from kernels.lora import Segments

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 40, 8, generator=g), torch.randn(5, 8, 30, generator=g)
    x, base = torch.randn(12, 40, generator=g), torch.randn(12, 30, generator=g)
    segments = [(0, 2, 4), (2, 3, 0), (4, 6, 2), (6, 8, 1), (9, 11, 3)]   # rows 3, 8 and 11: the base model's
    loop, batched = base.clone(), base.clone()
    reference(loop, x, a, b, segments)
    reference(batched, x, a, b, Segments(segments))
    assert torch.allclose(batched, loop, atol=1e-5) and not torch.equal(loop, base)
    assert torch.equal(batched[[3, 8, 11]], base[[3, 8, 11]])
