"""N-gram (prompt lookup) proposer: speculative tokens copied from earlier in the sequence.

The last n tokens are looked up, longest n first, at their latest earlier occurrence in the
prompt and output so far; what followed that occurrence is the proposal. No model, no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramConfig:
    min_n: int = 1
    max_n: int = 4
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        if self.min_n < 1:
            raise ValueError(f"ngram min_n must be >= 1, got {self.min_n}")
        if self.max_n < self.min_n:
            raise ValueError(f"ngram max_n ({self.max_n}) must be >= min_n ({self.min_n})")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")


def propose_ngram(tokens: np.ndarray | list[int], config: NgramConfig, k: int | None = None) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n-gram.

    Returns [] when no n-gram of any allowed length occurs earlier.
    """
    k = config.num_speculative_tokens if k is None else k
    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    for n in range(min(config.max_n, total - 1), config.min_n - 1, -1):
        suffix = seq[total - n:]
        # Candidate starts are 0 .. total-n-1: the suffix itself (start total-n) is excluded.
        windows = np.lib.stride_tricks.sliding_window_view(seq[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []
