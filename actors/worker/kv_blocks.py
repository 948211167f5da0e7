"""Whole KV blocks out of the paged cache as bytes, and back in: what a KV handoff moves.

The one place that knows how a block sits in the cache tensors. Each layer holds K and V
[num_blocks, slots, kv heads, dim] and, for an int8 or fp8 cache, their float32 scales
[num_blocks, kv heads] (actors.worker.model.LayerKV). A chunk of n blocks is every such tensor's
n rows in turn, scales first (so each part starts aligned for its dtype), each contiguous in the
tensor's own dtype; both ends of a handoff must agree on `layout`. A chunk of some layers only
(`layers`, a range) holds those layers' tensors alone, in the same order: a prompt's blocks can go
layer by layer, as the forward writes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class KVBlockIO:
    """`host=None`: a cache in host memory is copied through numpy views of its bytes (a block of
    60 tensors costs a few numpy slices, not hundreds of torch ops), one on an accelerator with
    torch; `host=False` forces torch (the tests compare the two)."""

    def __init__(self, kv_caches: Sequence[Sequence[torch.Tensor | None]], host: bool | None = None):
        layers = [[t for t in layer if t is not None] for layer in kv_caches]   # (K, V) or LayerKV
        scales = [(i, t) for i, layer in enumerate(layers) for t in layer[2:]]
        owned = scales + [(i, t) for i, layer in enumerate(layers) for t in layer[:2]]   # ..scales, K0, V0, K1, ...
        self.tensors = [t for _, t in owned]
        self._layer_of = [i for i, _ in owned]
        self.num_layers = len(layers)
        first = self.tensors[-1]
        self.device = first.device
        self.num_blocks = first.shape[0]
        self._row_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.bytes_per_block = sum(self._row_bytes)
        parts = ",".join(f"{str(t.dtype).removeprefix('torch.')}[{'x'.join(map(str, t.shape[1:]))}]"
                         for t in layers[0])
        self.layout = f"{len(layers)}x({parts})"
        if host is None:
            host = self.device.type == "cpu" and all(t.is_contiguous() for t in self.tensors)
        # Each tensor as [num_blocks, row bytes] of uint8, sharing its memory.
        self._rows = [t.view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in self.tensors] if host else None

    @property
    def on_host(self) -> bool:
        """Copied through numpy views: a read needs no device sync, so it may run beside the forward."""
        return self._rows is not None

    def nbytes(self, num_blocks: int, layers: range | None = None) -> int:
        """The bytes of `num_blocks` blocks of these layers (every layer by default)."""
        return num_blocks * sum(self._row_bytes[j] for j in self._picked(layers))

    def _picked(self, layers: range | None) -> list[int]:
        """The indices into `tensors` of these layers' tensors, in order."""
        if layers is None:
            return list(range(len(self.tensors)))
        if not (0 <= layers.start < layers.stop <= self.num_layers and layers.step == 1):
            raise ValueError(f"layers {layers.start}-{layers.stop} outside the cache's 0-{self.num_layers}")
        return [j for j, layer in enumerate(self._layer_of) if layer in layers]

    def read(self, block_ids: list[int], layers: range | None = None) -> memoryview:
        """The blocks' KV (of these layers; all by default), gathered into one buffer (the only copy
        on this side)."""
        n, runs = len(block_ids), _runs(block_ids)   # a pool hands out runs of neighbours: one slice each
        picked = self._picked(layers)
        if self._rows is not None:
            out = np.empty(self.nbytes(n, layers), dtype=np.uint8)
            for j, part in zip(picked, self._parts(out, n, picked)):
                rows = self._rows[j]
                for at, first, k in runs:
                    part[at:at + k] = rows[first:first + k]
            return out.data
        buf = torch.empty(self.nbytes(n, layers), dtype=torch.uint8, device=self.device)
        for t, part in zip((self.tensors[j] for j in picked), self._parts(buf, n, picked)):
            for at, first, k in runs:
                part.view(t.dtype).view(n, *t.shape[1:])[at:at + k].copy_(t[first:first + k])
        return memoryview(buf.cpu().numpy()).cast("B")

    def write(self, block_ids: list[int], data: bytes, layers: range | None = None) -> None:
        """Store what `read` gave for as many blocks (and the same layers) into these block ids."""
        n, runs = len(block_ids), _runs(block_ids)
        picked = self._picked(layers)
        if len(data) != self.nbytes(n, layers):
            raise ValueError(f"{len(data)} bytes for {n} blocks; expected {self.nbytes(n, layers)}")
        if self._rows is not None:
            for j, part in zip(picked, self._parts(np.frombuffer(data, dtype=np.uint8), n, picked)):
                rows = self._rows[j]
                for at, first, k in runs:
                    rows[first:first + k] = part[at:at + k]
            return
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        for t, part in zip((self.tensors[j] for j in picked), self._parts(src, n, picked)):
            rows = part.view(t.dtype).view(n, *t.shape[1:])
            for at, first, k in runs:
                t[first:first + k].copy_(rows[at:at + k])

    def _parts(self, buffer, num_blocks: int, picked: list[int]) -> list:
        """`buffer` (a flat uint8 array or tensor) cut into each picked tensor's share of `num_blocks`
        rows, in order: [num_blocks, row bytes] arrays, or flat tensors."""
        sizes = [self._row_bytes[j] for j in picked]
        if isinstance(buffer, np.ndarray):
            parts, at = [], 0
            for size in sizes:
                parts.append(buffer[at:at + num_blocks * size].reshape(num_blocks, size))
                at += num_blocks * size
            return parts
        return list(torch.split(buffer, [num_blocks * size for size in sizes]))


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in block_ids, first block id, length) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for at, block_id in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((at, block_id, 1))
    return runs
