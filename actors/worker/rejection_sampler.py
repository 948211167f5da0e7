"""Exact rejection sampling for speculative decoding: the emitted tokens follow the target.

A drafted token x is kept with probability min(1, p(x)/q(x)); the first rejected position is
resampled from norm(max(0, p - q)); when every draft is kept a bonus token comes from the
target. p and q are the *processed* distributions (temperature, top-k/p, min-p, penalties
applied the same way to both). A deterministic proposer (n-gram) has q = a point mass.
Greedy rows keep drafts while they equal the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpecRow:
    """One sequence's verification input.

    target_probs: [k+1, V] target distributions at the k drafted positions plus the bonus one.
    draft_probs:  [k, V] draft distributions, or None for a point-mass (deterministic) draft.
    """

    draft_token_ids: list[int]
    target_probs: torch.Tensor
    draft_probs: torch.Tensor | None = None
    greedy: bool = False
    generator: torch.Generator | None = None


def verify(rows: list[SpecRow]) -> list[list[int]]:
    """For each row, the emitted tokens: the accepted drafts then one corrected or bonus token."""
    return [_verify_row(row) for row in rows]


def _verify_row(row: SpecRow) -> list[int]:
    k = len(row.draft_token_ids)
    p = row.target_probs
    if p.shape[0] != k + 1:
        raise ValueError(f"target_probs has {p.shape[0]} rows for {k} drafted tokens (need k+1)")
    if row.greedy:
        return _verify_greedy(row.draft_token_ids, p)
    drafts = torch.tensor(row.draft_token_ids, dtype=torch.long)
    positions = torch.arange(k)
    p_x = p[positions, drafts]
    q_x = row.draft_probs[positions, drafts] if row.draft_probs is not None else torch.ones(k)
    uniforms = torch.rand(k, generator=row.generator, dtype=p.dtype)
    # Accept when u < p(x)/q(x), written without the division; q(x) > 0 as x was drawn from q.
    accepted = uniforms * q_x < p_x
    rejected = (~accepted).nonzero()
    if len(rejected) == 0:
        return row.draft_token_ids + [_sample(p[k], row.generator)]
    first = int(rejected[0])
    if row.draft_probs is not None:
        residual = (p[first] - row.draft_probs[first]).clamp_min(0)
    else:
        residual = p[first].clone()
        residual[drafts[first]] = 0
    if float(residual.sum()) <= 0:
        # Only reachable through rounding (p == q within float error): p itself is then exact.
        residual = p[first]
    return row.draft_token_ids[:first] + [_sample(residual, row.generator)]


def _verify_greedy(drafts: list[int], p: torch.Tensor) -> list[int]:
    targets = p.argmax(dim=-1).tolist()
    out: list[int] = []
    for draft, target in zip(drafts, targets):
        if draft != target:
            break
        out.append(draft)
    out.append(targets[len(out)])
    return out


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A draw from weights / weights.sum() (weights need not be normalised)."""
    return int(torch.multinomial(weights.float(), 1, generator=generator))
