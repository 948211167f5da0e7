"""Speculative verification is lossless: emitted tokens follow the target, whatever the draft."""

import math

import torch

from actors.worker.rejection_sampler import SpecRow, verify

V = 6
K = 3


def _chi2_critical(df: int, z: float = 3.719) -> float:
    # Wilson-Hilferty approximation of the chi-square quantile; z=3.719 is the 0.9999 normal
    # quantile, so a correct sampler fails this test about once in ten thousand runs.
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, dim=-1)
    # A draft that disagrees often: sharp and mostly on other tokens; one target zero exercises
    # the residual path where p(x) = 0.
    q = torch.softmax(torch.randn(K, V, generator=g) * 3.0, dim=-1)
    p[0, 0] = 0
    p[0] /= p[0].sum()
    return p, q


def _run(p, q, samples: int, point_mass: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Empirical distributions of the first and second emitted tokens, and the acceptance rate."""
    g = torch.Generator().manual_seed(1234)
    first = torch.zeros(V)
    second = torch.zeros(V)
    accepted = 0
    for _ in range(samples):
        if point_mass:
            drafts = [2, 2, 3]
            row = SpecRow(drafts, p, None, generator=g)
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(K)]
            row = SpecRow(drafts, p, q, generator=g)
        out = verify([row])[0]
        accepted += len(out) - 1
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second, accepted / (samples * K)


def test_sampled_drafts_are_lossless():
    # 6,000 samples, 5 degrees of freedom: the first emitted token must follow p[0], the second
    # p[1] (each position's target here does not depend on the earlier tokens).
    p, q = _dists(0)
    first, second, rate = _run(p, q, 6000, point_mass=False)
    assert 0.05 < rate < 0.95, f"acceptance {rate:.2f}: the test must exercise both paths"
    assert _chi2(first, p[0]) < _chi2_critical(V - 2)  # p[0] has one zero entry
    assert second.sum() > 1000
    assert _chi2(second, p[1]) < _chi2_critical(V - 1)


def test_point_mass_drafts_are_lossless():
    p, _ = _dists(1)
    first, second, rate = _run(p, None, 6000, point_mass=True)
    assert 0.0 < rate < 1.0
    assert _chi2(first, p[0]) < _chi2_critical(V - 2)
    assert _chi2(second, p[1]) < _chi2_critical(V - 1)


def test_wrong_statistic_is_detected():
    # The bound is tight enough to see a biased sampler: resampling from p instead of the
    # residual (the classic mistake) skews the first token toward the draft's favourites.
    p, q = _dists(0)
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(V)
    for _ in range(6000):
        x = int(torch.multinomial(q[0], 1, generator=g))
        keep = torch.rand(1, generator=g).item() < min(1.0, float(p[0, x] / q[0, x]))
        counts[x if keep else int(torch.multinomial(p[0], 1, generator=g))] += 1
    assert _chi2(counts, p[0]) > _chi2_critical(V - 2)


def test_greedy_keeps_the_agreeing_prefix():
    p = torch.zeros(K + 1, V)
    p[torch.arange(K + 1), torch.tensor([1, 2, 3, 4])] = 1.0
    assert verify([SpecRow([1, 2, 3], p, greedy=True)]) == [[1, 2, 3, 4]]
    assert verify([SpecRow([1, 5, 3], p, greedy=True)]) == [[1, 2]]
    assert verify([SpecRow([0, 2, 3], p, greedy=True)]) == [[1]]


def test_seeded_rows_repeat():
    p, q = _dists(2)
    drafts = [1, 2, 3]
    a = [verify([SpecRow(drafts, p, q, generator=torch.Generator().manual_seed(s))])[0] for s in range(20)]
    b = [verify([SpecRow(drafts, p, q, generator=torch.Generator().manual_seed(s))])[0] for s in range(20)]
    assert a == b
    assert len({tuple(x) for x in a}) > 1


def test_shape_mismatch_is_an_error():
    p, q = _dists(3)
    try:
        verify([SpecRow([1, 2], p, q[:2])])
    except ValueError as e:
        assert "k+1" in str(e)
    else:
        raise AssertionError("expected a ValueError")
