"""The device-resident adapters: a pool of --max-loras slots, filled on demand and least recently
used out first, and each step's LoRABatch, which adds every row's adapter to the projections.

Per adaptable module, one stacked A [slots, in, max_rank] and B [slots, max_rank, out] per layer:
an adapter of a smaller rank (or without that module) leaves zeros, so one batched call serves
every slot. The model's fused projections (q|k|v, gate|up) take each module's delta in the columns
where that module's output sits. Plain class, used on the worker's compute thread alone.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from actors.worker.lora_adapter import MODULES, LoRAAdapter, module_shapes
from actors.worker.model_config import ModelConfig
from kernels.lora import Segment
from kernels.lora import add_lora as lora_reference

# The model's matmuls and the modules each one holds, in the order of their output columns.
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


class LoRABatch:
    """One step's adapters: for each module, the row segments whose adapter adapts it."""

    def __init__(self, slots: LoRASlots, segments: list[Segment]) -> None:
        self.slots = slots
        self.by_module = {m: [s for s in segments if m in slots.modules[s[2]]] for m in MODULES}

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out (the `group` matmul's output for input x) += each row's adapter delta, in place."""
        column = 0
        for module in GROUPS[group]:
            width = self.slots.widths[module]
            segments = self.by_module[module]
            if segments:
                self.slots.add(out[:, column:column + width], x, self.slots.a[module][layer],
                               self.slots.b[module][layer], segments)
            column += width


class LoRASlots:
    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, add_lora=None) -> None:
        """add_lora: the ops' batched LoRA add (kernels/lora.py's signature); default the torch reference."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be positive, got {max_loras} and {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        shapes = module_shapes(cfg)
        self.widths = {m: shapes[m][1] for m in MODULES}
        zeros = dict(dtype=dtype, device=device)
        self.a = {m: [torch.zeros(max_loras, shapes[m][0], max_rank, **zeros) for _ in range(cfg.num_layers)]
                  for m in MODULES}
        self.b = {m: [torch.zeros(max_loras, max_rank, shapes[m][1], **zeros) for _ in range(cfg.num_layers)]
                  for m in MODULES}
        self.modules: list[frozenset[str]] = [frozenset()] * max_loras   # what each slot's adapter adapts
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # adapter uid -> slot, least recent first
        self.add = add_lora or lora_reference
        self.loads = 0                                          # adapters copied into a slot so far

    def resident(self, adapter: LoRAAdapter) -> bool:
        return adapter.uid in self._slot_of

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
        r = adapter.rank
        for module in MODULES:
            for layer, (a_stack, b_stack) in enumerate(zip(self.a[module], self.b[module])):
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                weights = adapter.weights.get((layer, module))
                if weights is not None:
                    a_stack[slot, :, :r].copy_(weights[0])
                    b_stack[slot, :r].copy_(weights[1])
        self.modules[slot] = adapter.modules
        self._slot_of[adapter.uid] = slot
        self.loads += 1
