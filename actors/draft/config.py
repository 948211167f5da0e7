"""The speculative-decoding configuration: `speculative={"method": ..., "num_speculative_tokens": k, ...}`.

Built once from the engine's keyword arguments (or `matinee serve` flags) and validated here with
clear ValueErrors; what depends on the target model (the layer count, the vocabulary) is checked
when the engine starts, by `check_against_target`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

METHODS = ("ngram", "draft", "layerskip")


@dataclass(frozen=True)
class SpeculativeConfig:
    # `metadata={"help": ...}` makes a field a `matinee serve` flag (gateway/flags.py); without
    # --speculative-method the engine does not speculate.
    method: str = field(metadata={
        "help": "draft tokens by prompt lookup, a small draft model, or the target's first layers",
        "flag": "speculative-method", "choices": METHODS})
    num_speculative_tokens: int = field(default=4, metadata={
        "help": "k: the most tokens drafted per sequence and step"})
    model: str | None = field(default=None, metadata={
        "help": "the draft model (method draft): HF folder, .gguf or hub id", "flag": "speculative-model"})
    draft_layers: int | None = field(default=None, metadata={
        "help": "L: the target's first L layers draft (method layerskip)",
        "flag": "speculative-draft-layers"})
    ngram_min: int = 1                         # n-gram lengths tried, longest first ("ngram" only)
    ngram_max: int = 4
    # Speculation turns off for the whole step while more sequences than this are decoding; None:
    # never. The controller already weighs each sequence's drafts against the whole step's time, so
    # it drafts in a large batch only for sequences whose acceptance pays for that; this is a cap.
    disable_batch_size: int | None = field(default=None, metadata={
        "help": 'no drafting while more sequences than this are decoding ("none": the controller drafts '
                "in a large batch only where a sequence's acceptance pays for it)",
        "flag": "speculative-disable-batch-size", "type": "int_or_none"})
    adaptive: bool = True                      # per-sequence k from its measured acceptance
    # Cost of one drafted token over one decode step: learned from the measured step times
    # (measure_cost), starting from draft_cost + verify_cost until enough steps are seen.
    verify_cost: float = 0.05                  # prior: one more verified position / one decode step
    draft_cost: float | None = None            # prior: one drafted token / one decode step; None: by method
    measure_cost: bool = True
    probe_interval: int = 16                   # steps a sequence stays off before it tries k=1 again
    # The id of a draft node (`matinee serve --role draft`) to draft on, instead of in this process
    # ("ngram" or "draft"; the node holds the draft model).
    draft_node: str | None = field(default=None, metadata={
        "help": "draft on this draft node (`--role draft --engine-id ID`) instead of in the engine",
        "flag": "speculative-draft-node"})

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 32], got {k!r}")
        if self.draft_node is not None:
            if self.method == "layerskip" or not self.draft_node:
                raise ValueError('"draft_node" needs a node id and method "ngram" or "draft" (layerskip shares '
                                 "the target's weights, so it runs in the engine)")
        elif self.method == "draft":
            if not self.model:
                raise ValueError('speculative method "draft" needs "model": the draft model\'s path')
        if self.model is not None and self.method != "draft":
            raise ValueError(f'"model" is only for speculative method "draft", not {self.method!r}')
        if self.method == "layerskip":
            L = self.draft_layers
            if not isinstance(L, int) or isinstance(L, bool) or L < 1:
                raise ValueError(f'speculative method "layerskip" needs "draft_layers" >= 1, got {L!r}')
        elif self.draft_layers is not None:
            raise ValueError(f'"draft_layers" is only for speculative method "layerskip", not {self.method!r}')
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        b = self.disable_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"disable_batch_size must be an integer >= 1 or None, got {b!r}")
        if self.verify_cost < 0 or (self.draft_cost is not None and self.draft_cost < 0):
            raise ValueError("verify_cost and draft_cost must be non-negative")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval must be at least 1, got {self.probe_interval}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From the `speculative=` engine argument: a dict (unknown keys are an error) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative option(s) {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f'speculative needs "method", one of {METHODS}')
        return cls(**value)

    def check_against_target(self, num_target_layers: int) -> None:
        if self.method == "layerskip" and self.draft_layers >= num_target_layers:
            raise ValueError(f"draft_layers={self.draft_layers} must be below the target's "
                             f"{num_target_layers} layers")

    def resolved_draft_cost(self, num_target_layers: int, draft_params: int = 0, target_params: int = 1) -> float:
        """One drafted token's cost relative to one target decode step."""
        if self.draft_cost is not None:
            return self.draft_cost
        if self.method == "ngram":
            return 0.0
        if self.method == "layerskip":
            return self.draft_layers / num_target_layers
        return draft_params / target_params
