"""Whole KV blocks out of the paged cache as bytes, and back in: what a KV handoff moves.

The one place that knows how a block sits in the cache tensors. A chunk of blocks is laid out
[layer][K, V][block][slot][kv head][dim], contiguous, in the cache's dtype; both ends of a handoff
must agree on `layout`. A cache with more tensors per layer (a quantized cache's scales) adds them
here, and to `layout`, and nothing else changes.
"""

from __future__ import annotations

import torch


class KVBlockIO:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.tensors = [t for pair in kv_caches for t in pair]   # K0, V0, K1, V1, ...
        first = self.tensors[0]
        self.block_shape = tuple(first.shape[1:])                # slots, kv heads, head dim
        self.dtype = first.dtype
        self.device = first.device
        self.num_blocks = first.shape[0]
        self.bytes_per_block = len(self.tensors) * first[0].numel() * first.element_size()
        dtype = str(self.dtype).removeprefix("torch.")
        self.layout = f"{dtype}:{len(kv_caches)}x2x" + "x".join(map(str, self.block_shape))

    def read(self, block_ids: list[int]) -> memoryview:
        """The blocks' KV, gathered into one buffer (the only copy on this side)."""
        out = torch.empty(len(self.tensors), len(block_ids), *self.block_shape, dtype=self.dtype, device=self.device)
        for at, first, n in _runs(block_ids):   # a pool hands out runs of neighbours: one slice each
            for i, t in enumerate(self.tensors):
                out[i, at:at + n].copy_(t[first:first + n])
        return memoryview(out.view(torch.uint8).cpu().numpy()).cast("B")

    def write(self, block_ids: list[int], data: bytes) -> None:
        """Store what `read` gave for as many blocks into these block ids."""
        expected = len(block_ids) * self.bytes_per_block
        if len(data) != expected:
            raise ValueError(f"{len(data)} bytes for {len(block_ids)} blocks; expected {expected}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype)
        src = src.view(len(self.tensors), len(block_ids), *self.block_shape).to(self.device)
        for at, first, n in _runs(block_ids):
            for i, t in enumerate(self.tensors):
                t[first:first + n].copy_(src[i, at:at + n])


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in block_ids, first block id, length) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for at, block_id in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((at, block_id, 1))
    return runs
