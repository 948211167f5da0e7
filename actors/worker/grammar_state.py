"""One constrained sequence's grammar matcher, and the token masks the sampler applies with it.

The matcher advances with every token the sequence keeps (SamplingState.append), so after a
preemption its state still follows the sequence: the recomputation redoes KV, not tokens. For
speculative verification a row's mask is the matcher's after that row's earlier drafts, accepted
for the fill and rolled back after it: the matcher only ever holds the tokens kept.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kernels.token_mask import apply_token_bitmask_


class GrammarState:
    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)

    @property
    def terminated(self) -> bool:
        """The grammar accepted its stop token: nothing may follow."""
        return self._matcher.is_terminated()

    def accept(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            if not self._matcher.accept_token(int(t)):
                raise ValueError(f"token {t} does not continue the structured output")

    def fill_mask(self, bitmask: torch.Tensor, row: int, drafted: Sequence[int] = ()) -> bool:
        """The allowed tokens after `drafted` into bitmask[row]; False (row untouched) when the grammar
        refuses one of `drafted` or ends within them: that row's position can never be emitted."""
        m, accepted = self._matcher, 0
        try:
            for t in drafted:
                if m.is_terminated() or not m.accept_token(int(t)):
                    return False
                accepted += 1
            if m.is_terminated():
                return False
            m.fill_next_token_bitmask(bitmask, row)
            return True
        finally:
            if accepted:
                m.rollback(accepted)


class TokenMasks:
    """Masks constrained rows of a logits batch in place: a token the grammar refuses gets -inf.
    Keeps its bitmask between calls (one per sampler, on the compute thread)."""

    def __init__(self) -> None:
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)

    def apply_(self, logits: torch.Tensor, rows: Sequence[tuple[int, GrammarState, Sequence[int]]]) -> None:
        """`rows`: (row, its sequence's grammar, the drafted tokens before that row's position)."""
        words = (logits.shape[1] + 31) // 32
        if self._bitmask.shape[0] < logits.shape[0] or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(logits.shape[0], words, dtype=torch.int32)
        bitmask = self._bitmask[:logits.shape[0]]
        masked = [row for row, grammar, drafted in rows if grammar.fill_mask(bitmask, row, drafted)]
        apply_token_bitmask_(logits, bitmask, masked)
