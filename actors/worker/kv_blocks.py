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
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        out = torch.stack([t.index_select(0, ids) for t in self.tensors])
        return memoryview(out.view(torch.uint8).cpu().numpy()).cast("B")

    def write(self, block_ids: list[int], data: bytes) -> None:
        """Store what `read` gave for as many blocks into these block ids."""
        expected = len(block_ids) * self.bytes_per_block
        if len(data) != expected:
            raise ValueError(f"{len(data)} bytes for {len(block_ids)} blocks; expected {expected}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype)
        src = src.view(len(self.tensors), len(block_ids), *self.block_shape).to(self.device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i, t in enumerate(self.tensors):
            t.index_copy_(0, ids, src[i])
