"""A step's index arrays sent to the GPU in one copy, from pinned memory.

The runner used to send a flattened batch's seven arrays one `.to(device)` each, from the ordinary
(pageable) memory numpy gave them. Such a copy is synchronous and staged by the driver, and on the H200
VM this ran on the engine's forward took 10-27 ms a step more than the same forward fed from device
memory (bench/BENCHMARKS.md, "On an NVIDIA H200"): about the count of those copies times a few
milliseconds. Here the arrays are packed into one page-locked int64 buffer and sent with one
non-blocking copy; on the device they are views of one tensor, in int64 (the caller converts those the
kernels read as int32). vLLM keeps its step inputs in pinned memory for the same reason.
"""
from __future__ import annotations

import torch


class PinnedBatch:
    def __init__(self, device: torch.device, pin: bool | None = None) -> None:
        """pin=None pins on CUDA; pin=False packs the same way in ordinary memory (what a CPU test runs)."""
        self.device = device
        self.pin = device.type == "cuda" if pin is None else pin
        self._host = torch.empty(0, dtype=torch.int64)
        self._on_device = torch.empty(0, dtype=torch.int64, device=device)
        # The last copy out of _host: the next packing waits for it, not to overwrite what it still reads.
        self._sent = torch.cuda.Event() if self.pin else None

    def send(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Integer CPU tensors -> int64 tensors of the same shapes on the device, in one copy."""
        sizes = [p.numel() for p in parts]
        total = sum(sizes)
        if total > self._host.numel():   # grown by doubling: a few reallocations over a server's life
            capacity = max(total, 2 * self._host.numel(), 1024)
            if self._sent is not None:
                self._sent.synchronize()
            self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=self.pin)
            self._on_device = torch.empty(capacity, dtype=torch.int64, device=self.device)
        elif self._sent is not None:
            self._sent.synchronize()
        at = 0
        for part, size in zip(parts, sizes):
            self._host[at:at + size].copy_(part.reshape(-1))
            at += size
        self._on_device[:total].copy_(self._host[:total], non_blocking=self.pin)
        if self._sent is not None:
            self._sent.record()
        out, at = [], 0
        for part, size in zip(parts, sizes):
            out.append(self._on_device[at:at + size].view(part.shape))
            at += size
        return out
