"""The device-resident adapters: a pool of --max-loras slots, filled on demand and least recently
used out first, and each step's LoRABatch, which adds every row's adapter to the projections.

The model's matmuls fuse q|k|v and gate|up; so do the slots. Per matmul (a group) and layer, one
stacked A [slots, in, n * max_rank] holds the group's n modules' A side by side, and one B
[slots, n * max_rank, out] their B block-diagonally, each in the output columns of its module: one
shrink and one expand per group serve all its modules. An adapter of a smaller rank, or without a
module, leaves zeros. Plain class, used on the worker's compute thread alone.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from actors.worker.lora_adapter import LoRAAdapter, module_shapes
from actors.model.config import ModelConfig
from kernels.lora import Layout, Segment, Segments
from kernels.lora import add_lora as lora_reference

# The model's matmuls and the modules each one holds, in the order of their output columns.
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


class LoRABatch:
    """One step's adapters: for each group, the row segments whose adapter adapts any of its modules."""

    def __init__(self, slots: LoRASlots, segments: list[Segment]) -> None:
        self.slots = slots
        self.by_group = {g: Segments(s for s in segments if g in slots.groups[s[2]]) for g in GROUPS}

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out (the `group` matmul's output for input x) += each row's adapter delta, in place."""
        segments = self.by_group[group]
        if segments:
            self.slots.add(out, x, self.slots.a[group][layer], self.slots.b[group][layer], segments,
                           self.slots.layouts[group])


class LoRASlots:
    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, add_lora=None) -> None:
        """add_lora: the ops' batched LoRA add (kernels/lora.py's signature); default the torch reference."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be positive, got {max_loras} and {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        shapes = module_shapes(cfg)
        # Where each module sits in its group: (group, its rank columns' start, its output columns' start, width).
        self.place: dict[str, tuple[str, int, int, int]] = {}
        self.a: dict[str, list[torch.Tensor]] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        self.ranks = [0] * max_loras   # the rank of each slot's adapter
        self.layouts: dict[str, Layout] = {}   # where each group's stacks may be non-zero (kernels that skip zeros)
        for group, modules in GROUPS.items():
            column = 0
            for j, module in enumerate(modules):
                self.place[module] = (group, j * max_rank, column, shapes[module][1])
                column += shapes[module][1]
            self.layouts[group] = Layout(tuple(self.place[m][1:] for m in modules), self.ranks)
            d_in, ranks = shapes[modules[0]][0], len(modules) * max_rank
            self.a[group] = [torch.zeros(max_loras, d_in, ranks, dtype=dtype, device=device)
                             for _ in range(cfg.num_layers)]
            self.b[group] = [torch.zeros(max_loras, ranks, column, dtype=dtype, device=device)
                             for _ in range(cfg.num_layers)]
        self.groups: list[frozenset[str]] = [frozenset()] * max_loras   # the groups each slot's adapter adapts
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # adapter uid -> slot, least recent first
        self.add = add_lora or lora_reference
        self.loads = 0                                          # adapters copied into a slot so far

    def batch(self, adapters: Sequence[LoRAAdapter | None], num_tokens: Sequence[int]) -> LoRABatch | None:
        """The LoRABatch of a step whose sequences read `adapters` (None: the base model) and compute
        `num_tokens` rows each, in batch order; None when no sequence has an adapter. Loads the adapters
        not resident, in the slots of the least recently used others; ValueError when the step holds
        more distinct adapters than there are slots."""
        if not any(adapters):
            return None
        slots = self._pin({a.uid: a for a in adapters if a is not None})
        segments: list[list[int]] = []
        row = 0
        for adapter, n in zip(adapters, num_tokens):
            slot = None if adapter is None else slots[adapter.uid]
            if slot is not None and segments and segments[-1][1] == row and segments[-1][2] == slot:
                segments[-1][1] += n   # neighbours of one adapter: one segment
            elif slot is not None:
                segments.append([row, row + n, slot])
            row += n
        return LoRABatch(self, [tuple(s) for s in segments])

    def _pin(self, wanted: dict[int, LoRAAdapter]) -> dict[int, int]:
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step holds {len(wanted)} adapters, more than --max-loras {self.max_loras}")
        for uid in wanted:
            if uid in self._slot_of:
                self._slot_of.move_to_end(uid)
        for uid, adapter in wanted.items():
            if uid not in self._slot_of:
                self._load(adapter, self._free_slot(wanted))
        return {uid: self._slot_of[uid] for uid in wanted}

    def _free_slot(self, keep: dict[int, LoRAAdapter]) -> int:
        used = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(uid for uid in self._slot_of if uid not in keep)   # the least recently used
        return self._slot_of.pop(victim)

    def _load(self, adapter: LoRAAdapter, slot: int) -> None:
        for stacks in (*self.a.values(), *self.b.values()):
            for layer_stack in stacks:
                layer_stack[slot].zero_()
        r = adapter.rank
        for (layer, module), (a, b) in adapter.weights.items():
            group, rank_at, column, width = self.place[module]
            self.a[group][layer][slot, :, rank_at:rank_at + r].copy_(a.t())
            # scaled in float32, then rounded once into a bfloat16 stack
            self.b[group][layer][slot, rank_at:rank_at + r, column:column + width].copy_(b.t().float() * adapter.scale)
        self.groups[slot] = frozenset(self.place[m][0] for m in adapter.modules)
        self.ranks[slot] = r
        self._slot_of[adapter.uid] = slot
        self.loads += 1
