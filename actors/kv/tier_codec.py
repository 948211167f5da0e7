"""How a float pool's blocks are kept in the KV tier as int8 (`--kv-offload-dtype int8`): each K or V
of each layer as one byte a value and a float32 scale per KV head (absmax / 127 over the block's slots
and the head's dim), restored to the pool's dtype when the block comes back. A quarter of a float32
block's bytes, about half a bfloat16 one's.

What it promises: every restored value is within half a step of the one computed (|x - x'| <= scale/2
for its head and block), so attention reads near, not equal, KV; greedy text after a reload is close to,
not always the same as, the computed one. Never for a pool that is already int8 or fp8 (its blocks, with
their scales, go to the tier as they are).
"""

from __future__ import annotations

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Int8BlockCodec:
    """Built from the pool's KVBlockIO: its tensors' dtypes and row shapes fix both layouts."""

    def __init__(self, tensors: list[torch.Tensor]):
        rows = [(t.dtype, tuple(t.shape[1:])) for t in tensors]
        if any(dtype not in _FLOATS or len(shape) != 3 for dtype, shape in rows):
            raise ValueError("an int8 KV tier is for a float KV cache (an int8 or fp8 cache's blocks go to "
                             "the tier as they are): use --kv-offload-dtype auto")
        self._rows = rows
        self.raw_bytes = sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                             for dtype, shape in rows)
        # Per tensor: a float32 scale per head, then the int8 values.
        self.stored_bytes = sum(4 * shape[1] + torch.Size(shape).numel() for _, shape in rows)

    def encode(self, raw: bytes | memoryview) -> bytes:
        """One block's bytes as the pool holds them -> its int8 form."""
        if len(raw) != self.raw_bytes:
            raise ValueError(f"{len(raw)} bytes for a block of {self.raw_bytes}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out, at = [], 0
        for dtype, shape in self._rows:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            x = flat[at:at + size].view(dtype).view(shape).float()   # [slots, heads, dim]
            at += size
            scale = x.abs().amax(dim=(0, 2)) / 127.0                  # per head
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(x / safe[None, :, None]).clamp(-127, 127).to(torch.int8)
            out += [scale.numpy().tobytes(), q.numpy().tobytes()]
        return b"".join(out)

    def decode(self, stored: bytes) -> bytes:
        """Its int8 form -> the block's bytes in the pool's dtype."""
        if len(stored) != self.stored_bytes:
            raise ValueError(f"{len(stored)} bytes for an int8 block of {self.stored_bytes}")
        flat = torch.frombuffer(bytearray(stored), dtype=torch.uint8)
        out, at = [], 0
        for dtype, shape in self._rows:
            heads, n = shape[1], torch.Size(shape).numel()
            scale = flat[at:at + 4 * heads].view(torch.float32)
            q = flat[at + 4 * heads:at + 4 * heads + n].view(torch.int8).view(shape)
            at += 4 * heads + n
            x = (q.float() * scale[None, :, None]).to(dtype)
            out.append(x.view(torch.uint8).numpy().tobytes())
        return b"".join(out)
