"""Exact rejection sampling for speculative decoding: the emitted tokens follow the target.

A drafted token x is kept with probability min(1, p(x)/q(x)); the first rejected position is
resampled from norm(max(0, p - q)); when every draft is kept a bonus token comes from the
target. p and q are the *processed* distributions (temperature, top-k/p, min-p, penalties
applied the same way to both). A deterministic proposer (n-gram) has q = a point mass.
Greedy rows keep drafts while they equal the target's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from actors.worker.sampler import row_argmax


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


@dataclass
class SpecSeq:
    """One sequence's draft as the worker receives it, with its sampling state (duck-typed:
    `greedy`, `generator`, the fields Sampler.processed_probs reads)."""

    state: object
    draft_token_ids: list[int]
    draft_probs: bytes = b""      # float32 [k, V]; empty: a point mass on each draft


def verify_logits(sampler, logits: torch.Tensor, seqs: Sequence[SpecSeq],
                  generator: torch.Generator | None = None) -> list[list[int]]:
    """Emitted tokens per sequence from the target's logits: k+1 consecutive rows per sequence.

    p comes from the same `processed_probs` the draft used for q, with the earlier drafts of
    the same sequence counted as output for the penalties. Rows without a seed draw from
    `generator` (the worker's), seeded rows from their own.
    """
    states, extra = [], []
    for seq in seqs:
        for j in range(len(seq.draft_token_ids) + 1):
            states.append(seq.state)
            extra.append(seq.draft_token_ids[:j])
    if logits.shape[0] != len(states):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(states)} verified positions")
    p = sampler.processed_probs(logits, states, extra)
    rows, start = [], 0
    for seq in seqs:
        k = len(seq.draft_token_ids)
        q = None
        if seq.draft_probs:
            q = torch.from_numpy(np.frombuffer(seq.draft_probs, dtype=np.float32).copy()).view(k, -1)
            if q.shape[1] != p.shape[1]:
                raise ValueError(f"draft distributions over {q.shape[1]} tokens, target over {p.shape[1]}")
        gen = seq.state.generator if seq.state.generator is not None else generator
        rows.append(SpecRow(seq.draft_token_ids, p[start:start + k + 1], q, seq.state.greedy, gen))
        start += k + 1
    return verify(rows)


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
    if not float(residual.sum()) > 0:
        # Only reachable through rounding (p == q within float error), where p itself is exact, or
        # from a draft distribution with NaNs in it (not drawn from any distribution: p is the answer).
        residual = p[first]
    return row.draft_token_ids[:first] + [_sample(residual, row.generator)]


def _verify_greedy(drafts: list[int], p: torch.Tensor) -> list[int]:
    targets = row_argmax(p).tolist()
    out: list[int] = []
    for draft, target in zip(drafts, targets):
        if draft != target:
            break
        out.append(draft)
    out.append(targets[len(out)])
    return out


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A draw from weights / weights.sum() (weights need not be normalised): one uniform, inverse CDF."""
    return int(draw_rows(weights.float().unsqueeze(0), [generator])[0])


def draw_rows(weights: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of non-negative `weights` [B, V], row i driven by generators[i].

    Inverse CDF on one uniform per row: far cheaper than torch.multinomial per row, and a
    zero-weight token is never drawn (its running sum never first exceeds the target).
    """
    u = torch.stack([torch.rand((), generator=g, dtype=weights.dtype) for g in generators])
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
