"""Quantized matmuls as dequantize-then-matmul in float32: the pure-torch reference.

This is the oracle for quant_matmul_triton.py and quant_linear_cpu.py, and reads the layouts
that quantize.py describes. GGUF blocks (32 weights each, as the `gguf` package stores them):
Q8_0 = fp16 d, 32 int8 q; w = q * d. Q4_0 = fp16 d, 16 bytes; w = (q - 8) * d. Q4_1 = fp16 d,
fp16 m, 16 bytes; w = q * d + m. In the Q4 blocks byte j holds element j in its low nibble and
element j + 16 in its high nibble.
"""

from __future__ import annotations

import torch

from kernels.quantize import GGUF_BLOCK_BYTES, GGMLType, GGUFWeight, Int4Weight, Int8Weight, \
    quantize_activations, unpack_nibbles


def dequantize_int8(weight: Int8Weight) -> torch.Tensor:
    """-> float32 [N, K]."""
    return weight.qweight.float() * weight.scale.float()[:, None]


def dequantize_int4(weight: Int4Weight) -> torch.Tensor:
    """-> float32 [N, K], inputs in their own order."""
    q = unpack_nibbles(weight.qweight).float()
    n, k = q.shape
    zero = 8.0 if weight.zero is None else weight.zero.float()[:, :, None]
    groups = (q.view(n, k // weight.group_size, weight.group_size) - zero) * weight.scale.float()[:, :, None]
    if weight.order is None:
        return groups.view(n, k)
    return torch.empty(n, k).index_copy_(1, weight.order, groups.view(n, k))


def dequantize_gguf(weight: GGUFWeight) -> torch.Tensor:
    """-> float32 [N, K], the values gguf.quants.dequantize gives for the same bytes."""
    n = weight.out_features
    blocks = weight.raw.reshape(-1, GGUF_BLOCK_BYTES[weight.qtype])
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if weight.qtype == GGMLType.Q8_0:
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * d).view(n, -1)
    packed = blocks[:, 2:] if weight.qtype == GGMLType.Q4_0 else blocks[:, 4:]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()
    if weight.qtype == GGMLType.Q4_0:
        return ((q - 8.0) * d).view(n, -1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (q * d + m).view(n, -1)


def dequantize(weight: Int8Weight | Int4Weight | GGUFWeight) -> torch.Tensor:
    if isinstance(weight, Int8Weight):
        return dequantize_int8(weight)
    if isinstance(weight, Int4Weight):
        return dequantize_int4(weight)
    return dequantize_gguf(weight)


def embedding(ids: torch.Tensor, weight: Int8Weight | Int4Weight | GGUFWeight) -> torch.Tensor:
    """Rows `ids` of the dequantized weight (float32 [*ids.shape, K]), dequantizing those rows only:
    what a tied embedding reads out of a quantized LM head."""
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= weight.out_features):
        raise IndexError(f"token id out of range [0, {weight.out_features})")
    fields = {name: getattr(weight, name) for name in weight.__dataclass_fields__}
    picked = {name: v[flat] if torch.is_tensor(v) and name != "order" else v for name, v in fields.items()}
    return dequantize(type(weight)(**picked)).view(*ids.shape, -1)


def linear(x: torch.Tensor, weight: Int8Weight | Int4Weight | GGUFWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[M, K] @ dequantize(weight).T (+ bias), in float32, returned in x's dtype."""
    y = x.float() @ dequantize(weight).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int8_dynamic_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU int8 path's math, bit for bit: x quantized per token, exact integer products (float64
    holds any int32 sum exactly), then x's scale and the weight's applied in that order."""
    xq, x_scale = quantize_activations(x)
    y = (xq.double() @ weight.qweight.double().t()).float()
    y = y.mul_(x_scale[:, None]).mul_(weight.scale.float()[None, :])
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x.dtype)
