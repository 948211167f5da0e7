"""Embeddings: a prompt's hidden states (after the final norm) pooled into one vector.

The pooling is the model's own: a sentence-transformers folder says it (`modules.json`, its
Pooling module's `config.json`: mean, CLS or last token; a Normalize module: unit length); any
other model pools its last token and normalises, as vLLM embeds with a decoder. A prompt may be
computed in several chunks: the pool sums what each chunk gives and is whole at the prompt's end.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

KINDS = ("mean", "cls", "last")


@dataclass(frozen=True)
class Pooling:
    kind: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown pooling {self.kind!r}; expected one of {', '.join(KINDS)}")

    def wanted(self, prompt_len: int) -> range:
        """The prompt positions whose hidden states the pool reads."""
        match self.kind:
            case "mean":
                return range(0, prompt_len)
            case "cls":
                return range(0, 1)
            case _:
                return range(prompt_len - 1, prompt_len)


def read_pooling(folder: str | None) -> Pooling:
    """The pooling a model folder's sentence-transformers modules describe; the default otherwise."""
    modules_path = os.path.join(folder, "modules.json") if folder and os.path.isdir(folder) else None
    if modules_path is None or not os.path.isfile(modules_path):
        return Pooling()
    with open(modules_path, encoding="utf-8") as f:
        modules = json.load(f)
    kind, normalize = "last", False
    for m in modules:
        module_type = m.get("type", "")
        if module_type.endswith("Pooling"):
            with open(os.path.join(folder, m.get("path", ""), "config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
            modes = [k for k, key in (("mean", "pooling_mode_mean_tokens"), ("cls", "pooling_mode_cls_token"),
                                      ("last", "pooling_mode_lasttoken")) if cfg.get(key)]
            if len(modes) != 1:
                raise ValueError(f"{folder}: pooling modes {modes or 'none'}; one of mean, CLS or last "
                                 "token is supported")
            kind = modes[0]
        elif module_type.endswith("Normalize"):
            normalize = True
    return Pooling(kind, normalize)


class PoolState:
    """One sequence's pool while its prompt is computed: `add` each chunk's rows, `take` the vector."""

    def __init__(self, pooling: Pooling, prompt_len: int) -> None:
        self.pooling = pooling
        self.wanted = pooling.wanted(prompt_len)
        self.done = self.wanted.start      # positions before this are in the sum
        self.sum: torch.Tensor | None = None

    def positions(self, start: int, length: int) -> range:
        """The positions of a chunk [start, start + length) the pool still needs (none twice: a
        retried or recomputed chunk adds nothing it has)."""
        return range(max(start, self.done), min(start + length, self.wanted.stop))

    def add(self, rows: torch.Tensor) -> None:
        """Hidden states [n, hidden] of the next `n` positions `positions` gave."""
        total = rows.float().sum(dim=0)
        self.sum = total if self.sum is None else self.sum + total
        self.done += rows.shape[0]

    def take(self) -> list[float] | None:
        """The pooled vector once every wanted position is in; None before."""
        if self.sum is None or self.done < self.wanted.stop:
            return None
        vector = self.sum / len(self.wanted)
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        self.sum = None
        return vector.tolist()
