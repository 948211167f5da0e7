"""token_mask.c against xgrammar's own apply: the same -inf at the same tokens, the rest untouched."""

import pytest
import torch

from kernels.token_mask import apply_token_bitmask_


def _bitmask(rows: int, vocab: int, density: float, seed: int) -> torch.Tensor:
    """xgrammar's layout: bit t % 32 of word t / 32 set when token t is allowed."""
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    allowed = torch.rand(rows, words * 32, generator=g) < density
    allowed[:, : words * 32 : 97] = False   # every density refuses some, and some words are mixed
    packed = torch.zeros(rows, words, dtype=torch.int64)
    for bit in range(32):
        packed |= allowed[:, bit::32].long() << bit
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[1]
    for r in rows:
        bits = torch.tensor([(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
        out[r, ~bits] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [32, 1000, 4099])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.6, 0.97, 1.0])
def test_mask_matches_a_per_token_reference(each_build, vocab, density):
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    bitmask = _bitmask(5, vocab, density, seed=vocab + int(density * 100))
    rows = [0, 2, 3]
    want = _reference(logits, bitmask, rows)
    got = logits.clone()
    apply_token_bitmask_(got, bitmask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])   # rows not named are untouched


def test_strided_rows_and_the_xgrammar_path_agree(each_build):
    import xgrammar as xgr

    wide = torch.randn(4, 1100)
    beyond = wide[:, 1027:].clone()
    logits = wide[:, :1027]   # a row stride wider than the vocabulary
    bitmask = _bitmask(4, 1027, 0.5, seed=1)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=[1, 3])
    apply_token_bitmask_(logits, bitmask, [1, 3])
    assert torch.equal(logits, want)
    assert torch.equal(wide[:, 1027:], beyond)   # nothing written past a row's vocabulary


def test_a_bitmask_too_small_or_a_row_outside_is_refused():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="does not cover"):
        apply_token_bitmask_(logits, torch.zeros(2, 1, dtype=torch.int32), [0])
    with pytest.raises(ValueError, match="outside"):
        apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), [2])
