"""Quantized weight layouts and the pure functions that write them from float weights at load.

Every quantized matmul in kernels/ reads one of these layouts, all [N, K] row-major like a
float weight (N outputs, K inputs):

- Int8Weight: `qweight` int8 [N, K], `scale` float32 [N]; w[n, k] = qweight[n, k] * scale[n]
  (symmetric, per output channel).
- Int4Weight: `qweight` uint8 [N, K // 2], byte j of a row holding element 2j in its low nibble
  and 2j + 1 in its high nibble; `scale` float16 [N, K // G]; `zero` uint8 [N, K // G] (one
  zero point per byte, 0..15, or 16 from a GPTQ checkpoint whose stored -1 wrapped) or None for
  symmetric groups (zero point 8);
  w[n, k] = (nibble[n, k] - zero[n, k // G]) * scale[n, k // G]. The same math as GPTQ and AWQ.
- GGUFWeight: `raw` uint8 [N, K // 32 * block bytes], the rows exactly as the `gguf` package
  stores a Q8_0, Q4_0 or Q4_1 tensor (see quant_matmul.dequantize_gguf for the blocks).

Activations quantized at run time (the CPU's int8 path) are per token: int8 rows and a float32
scale per row. Nothing here multiplies; quant_matmul.py is the reference that does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType as GGMLType

INT4_GROUP_SIZES = (32, 64, 128)
# Bytes of one 32-weight block, by GGUF type: an fp16 scale (+ an fp16 min) and the quants.
GGUF_BLOCK_BYTES = {GGMLType.Q8_0: 34, GGMLType.Q4_0: 18, GGMLType.Q4_1: 20}
GGUF_BLOCK = 32


@dataclass(frozen=True)
class Int8Weight:
    qweight: torch.Tensor   # int8 [N, K]
    scale: torch.Tensor     # float32 [N]
    row_sums: torch.Tensor | None = None   # int32 [N]: each row's sum, where the CPU's int8_gemm.c reads it
    amx_from: int | None = None            # the CPU's int8_amx.c serves calls of this many rows and more

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]


def in_order(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """x[..., K] with its inputs in an int4 weight's column order (Int4Weight.order; None: as they are)."""
    return x if order is None else x.index_select(-1, order)


@dataclass(frozen=True)
class Int4Weight:
    qweight: torch.Tensor          # uint8 [N, K // 2], two nibbles a byte (element 2j low)
    scale: torch.Tensor            # float16 [N, K // group_size]
    zero: torch.Tensor | None      # uint8 [N, K // group_size], 0..16; None: symmetric (8)
    group_size: int
    # int64 [K]: column j multiplies input order[j] (a GPTQ checkpoint quantized in activation order, its
    # inputs sorted so that each group is contiguous); None: column j multiplies input j
    order: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 2


@dataclass(frozen=True)
class GGUFWeight:
    raw: torch.Tensor       # uint8 [N, K // 32 * GGUF_BLOCK_BYTES[qtype]]
    qtype: GGMLType

    def __post_init__(self) -> None:
        if self.qtype not in GGUF_BLOCK_BYTES:
            raise ValueError(f"GGUF type {self.qtype!r} is not one of {[t.name for t in GGUF_BLOCK_BYTES]}")
        if self.raw.dtype != torch.uint8 or self.raw.dim() != 2 or self.raw.shape[1] % GGUF_BLOCK_BYTES[self.qtype]:
            raise ValueError(f"a {self.qtype.name} weight is uint8 rows of whole {GGUF_BLOCK_BYTES[self.qtype]}-byte "
                             f"blocks, not {self.raw.dtype} {tuple(self.raw.shape)}")

    @property
    def out_features(self) -> int:
        return self.raw.shape[0]

    @property
    def in_features(self) -> int:
        return self.raw.shape[1] // GGUF_BLOCK_BYTES[self.qtype] * GGUF_BLOCK


def _check_weight(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"a matmul weight to quantize is a float [N, K] tensor, not {weight.dtype} {tuple(weight.shape)}")
    weight = weight.float()
    if not torch.isfinite(weight).all():
        raise ValueError("cannot quantize a weight holding inf or NaN")
    return weight


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """float [N, K] -> Int8Weight: symmetric per output channel, scale = max |w| of the row / 127."""
    weight = _check_weight(weight)
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    qweight = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(qweight.contiguous(), scale.contiguous())


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers 0..15 (K even) -> uint8 [N, K // 2], element 2j in byte j's low nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 [N, K], the inverse of pack_nibbles."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(1)


def quantize_int4(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> Int4Weight:
    """float [N, K] -> Int4Weight, groups of `group_size` consecutive inputs of one output.

    Asymmetric (the default): scale = (max - min) / 15 and an integer zero point per group, so
    the group's range maps onto 0..15. Symmetric: scale = max |w| / 7, zero point 8 (not stored).
    The scale is rounded to float16 before the weights are divided by it, so dequantizing with
    the stored scale is the value that was rounded."""
    weight = _check_weight(weight)
    n, k = weight.shape
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, not {group_size}")
    if k % group_size:
        raise ValueError(f"int4 groups of {group_size} do not divide the weight's {k} inputs")
    groups = weight.view(n, k // group_size, group_size)
    if symmetric:
        scale = (groups.abs().amax(dim=2) / 7).clamp(min=1e-7).half().float()
        zero = torch.full_like(scale, 8.0)
    else:
        low, high = groups.amin(dim=2).clamp(max=0), groups.amax(dim=2).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-7).half().float()
        zero = torch.round(-low / scale).clamp(0, 15)
    q = torch.round(groups / scale[:, :, None] + zero[:, :, None]).clamp(0, 15).view(n, k)
    return Int4Weight(pack_nibbles(q), scale.half().contiguous(),
                      None if symmetric else zero.to(torch.uint8).contiguous(), group_size)


def int4_group_size_for(in_features: int, preferred: int = 128) -> int:
    """The largest supported group size no larger than `preferred` that divides `in_features`
    (SmolLM2's 576 inputs take 64, not 128)."""
    for size in sorted(INT4_GROUP_SIZES, reverse=True):
        if size <= preferred and in_features % size == 0:
            return size
    raise ValueError(f"no int4 group size in {INT4_GROUP_SIZES} divides {in_features} inputs")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [M, K] -> (int8 [M, K], float32 scale [M]): symmetric per token, max |x| of the row / 127."""
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(xf / scale[:, None]).clamp(-127, 127).to(torch.int8), scale
