"""The quantizers write the layouts quantize.py describes, within half a step of the float weight."""

import pytest
import torch

from kernels.quant_matmul import dequantize, dequantize_int4, dequantize_int8, embedding
from kernels.quantize import int4_group_size_for, pack_nibbles, quantize_activations, quantize_int4, \
    quantize_int8, unpack_nibbles


def _weight(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5


def test_int8_is_symmetric_per_output_channel():
    w = _weight(9, 40)
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.scale.dtype == torch.float32 and q.scale.shape == (9,)
    # Each row's largest magnitude lands on +-127; every weight within half a step.
    assert torch.equal(q.qweight.abs().amax(dim=1), torch.full((9,), 127, dtype=torch.int8))
    assert ((dequantize_int8(q) - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_groups_are_within_half_a_step(group_size, symmetric):
    w = _weight(5, 256, seed=group_size)
    q = quantize_int4(w, group_size, symmetric=symmetric)
    assert q.qweight.shape == (5, 128) and q.qweight.dtype == torch.uint8
    assert q.scale.shape == (5, 256 // group_size) and q.scale.dtype == torch.float16
    assert (q.zero is None) == symmetric
    if not symmetric:
        assert q.zero.dtype == torch.uint8 and int(q.zero.max()) <= 15
    step = q.scale.float().repeat_interleave(group_size, dim=1)
    assert ((dequantize_int4(q) - w).abs() <= step / 2 + 1e-6).all()


def test_int4_asymmetric_uses_the_whole_range_of_a_one_signed_group():
    # A group of positive weights only: zero point 0 and the maximum on 15.
    w = torch.linspace(0.1, 1.0, 32)[None, :]
    q = quantize_int4(w, 32)
    assert int(q.zero) == 0 and int(unpack_nibbles(q.qweight).max()) == 15


def test_nibbles_hold_element_2j_low_and_2j_plus_1_high():
    q = torch.tensor([[1, 2, 15, 0]])
    assert pack_nibbles(q).tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q.to(torch.uint8))


def test_quantizers_reject_bad_input():
    with pytest.raises(ValueError, match="do not divide"):
        quantize_int4(_weight(4, 96), 64)
    with pytest.raises(ValueError, match="group size must be one of"):
        quantize_int4(_weight(4, 96), 48)
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="float \\[N, K\\]"):
        quantize_int8(torch.ones(4, dtype=torch.int32))


def test_group_size_for_inputs():
    assert int4_group_size_for(4096) == 128 and int4_group_size_for(576) == 64
    assert int4_group_size_for(4096, preferred=32) == 32
    with pytest.raises(ValueError, match="divides 100"):
        int4_group_size_for(100)


def test_activations_per_token_within_half_a_step():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * torch.tensor([[0.01], [1.0], [100.0]])
    xq, scale = quantize_activations(x)
    assert xq.dtype == torch.int8 and scale.shape == (3,)
    assert ((xq.float() * scale[:, None] - x).abs() <= scale[:, None] / 2 * 1.0001).all()


def test_embedding_reads_rows_of_any_layout():
    from tests.kernels.test_quant_matmul_triton import FORMATS

    ids = torch.tensor([[3, 0], [46, 3]])
    for fmt, (quantize, k) in FORMATS.items():
        weight = quantize(_weight(47, k))
        assert torch.equal(embedding(ids, weight), dequantize(weight)[ids]), fmt
    with pytest.raises(IndexError, match="out of range"):
        embedding(torch.tensor([47]), weight)
