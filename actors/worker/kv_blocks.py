"""Whole KV blocks out of the paged cache as bytes, and back in: what a KV handoff moves.

The one place that knows how a block sits in the cache tensors. Each layer holds K and V
[num_blocks, slots, kv heads, dim] and, for an int8 or fp8 cache, their float32 scales
[num_blocks, kv heads] (actors.worker.model.LayerKV). A chunk of n blocks is every such tensor's
n rows in turn, scales first (so each part starts aligned for its dtype), each contiguous in the
tensor's own dtype; both ends of a handoff must agree on `layout`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVBlockIO:
    def __init__(self, kv_caches: Sequence[Sequence[torch.Tensor | None]]):
        layers = [[t for t in layer if t is not None] for layer in kv_caches]   # (K, V) or LayerKV
        scales = [t for layer in layers for t in layer[2:]]
        self.tensors = scales + [t for layer in layers for t in layer[:2]]      # ..scales, K0, V0, K1, V1, ...
        first = self.tensors[-1]
        self.device = first.device
        self.num_blocks = first.shape[0]
        self._row_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.bytes_per_block = sum(self._row_bytes)
        parts = ",".join(f"{str(t.dtype).removeprefix('torch.')}[{'x'.join(map(str, t.shape[1:]))}]"
                         for t in layers[0])
        self.layout = f"{len(layers)}x({parts})"

    def read(self, block_ids: list[int]) -> memoryview:
        """The blocks' KV, gathered into one buffer (the only copy on this side)."""
        out = torch.empty(len(block_ids) * self.bytes_per_block, dtype=torch.uint8, device=self.device)
        for t, part in zip(self.tensors, self._parts(out, len(block_ids))):
            for at, first, n in _runs(block_ids):   # a pool hands out runs of neighbours: one slice each
                part.view(t.dtype).view(len(block_ids), *t.shape[1:])[at:at + n].copy_(t[first:first + n])
        return memoryview(out.cpu().numpy()).cast("B")

    def write(self, block_ids: list[int], data: bytes) -> None:
        """Store what `read` gave for as many blocks into these block ids."""
        expected = len(block_ids) * self.bytes_per_block
        if len(data) != expected:
            raise ValueError(f"{len(data)} bytes for {len(block_ids)} blocks; expected {expected}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        for t, part in zip(self.tensors, self._parts(src, len(block_ids))):
            rows = part.view(t.dtype).view(len(block_ids), *t.shape[1:])
            for at, first, n in _runs(block_ids):
                t[first:first + n].copy_(rows[at:at + n])

    def _parts(self, buffer: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
        """`buffer` cut into each tensor's share of `num_blocks` rows, in `self.tensors`' order."""
        return list(torch.split(buffer, [num_blocks * size for size in self._row_bytes]))


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in block_ids, first block id, length) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for at, block_id in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((at, block_id, 1))
    return runs
