"""int8 and int4 projections on the CPU.

int8 (W8A8, dynamic): the Int8Weight stays as quantize.py writes it; each call quantizes x per
token (quantize.quantize_activations, through int8_rows.c where it can), multiplies int8 x int8 -> int32 and applies both scales:
through int8_amx.c (AMX-INT8 tiles) from the row count measured for the weight's shape on
(int8_amx.py; `amx_from`), else through int8_gemm.c (vpdpbusd) where the CPU has AVX-512 VNNI and
the step has at most INT8_KERNEL_ROWS rows, else through torch._int_mm, which takes any M, N, K on the
CPU, and the [N, K] weight as its transposed view (a [K, N] copy measured slower). The three agree bit
for bit, so the row count picking one never changes a row's result. On a Zen 4 core (Llama-3.2-1B's 8192x2048 and
2048x8192): at one row both ~0.3 ms; at 4-16 rows int8_gemm.c 0.8-4.1 ms against _int_mm's 3.3-6.9
(_int_mm falls off a cliff past one row); at 64 rows _int_mm 7.8-10.5 against 11.0. On a Xeon core
with AMX (one thread, a shared machine, best of 21; 8192x2048 at 16 / 64 / 256 rows): int8_amx.c 1.19 /
1.75 / 4.3 ms, _int_mm 1.46 / 2.43 / 8.0, int8_gemm.c 3.5 / 12.8 / 50, a bf16 F.linear 2.9 / 4.3 / 10.8;
at 2048x8192 and 256 rows _int_mm led, 5.6 against 6.8.
torch._weight_int8pack_mm, the weight-only int8 matmul, measured slower than float32 here.
bench/quant_linear_cpu.py times both paths against the float32 and bf16 kernels.

int4 (weight-only): torch.ops.aten._weight_int4pack_mm_for_cpu, on a weight repacked once
by prepare_int4 with _convert_weight_to_int4pack_for_cpu. Its math is
w = (q - 8) * scale + offset per group, offset = (8 - zero) * scale, with scales and offsets
[K // G, N, 2] in the activation dtype; it needs N a multiple of 16 (padded here with zero
rows) and groups of 32, 64, 128 or 256. Prepare it for bfloat16: with float32 activations torch
2.13 takes a path 24-31x slower at one row on this CPU (bench/quant_linear_cpu.py).
Reference: quant_matmul.py (int8_dynamic_linear, linear).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels import cpu_native, int8_amx
from kernels.quantize import Int4Weight, Int8Weight, in_order, quantize_activations, unpack_nibbles

INT8_KERNEL_ROWS = 16   # int8_gemm.c up to this many rows, torch._int_mm beyond (measured, see above)
INT4_N_MULTIPLE = 16
INT4_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class Int4CpuWeight:
    packed: torch.Tensor            # uint8 [N padded to 16, K // 2], torch's CPU int4 layout
    scale_and_offset: torch.Tensor  # [K // G, N padded, 2] in the activation dtype
    group_size: int
    out_features: int
    in_features: int
    order: torch.Tensor | None = None   # Int4Weight.order


def prepare_int8(weight: Int8Weight, measure: bool = True) -> Int8Weight:
    """The weight with the row sums int8_gemm.c reads (4 bytes a row, kept on every CPU, so the resident
    bytes do not depend on which path this CPU takes) and, where the kernels have AMX-INT8, the row count
    from which int8_amx.c serves it (measured once per shape; `measure=False` leaves it None)."""
    amx_from = int8_amx.from_rows(*weight.qweight.shape, int8_linear) if measure and int8_amx.available() else None
    return replace(weight, row_sums=weight.qweight.sum(dim=1, dtype=torch.int32).contiguous(), amx_from=amx_from)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """x[M, K] (float) @ weight.T (+ bias) -> [M, N] in x's dtype, x quantized per token; through
    int8_amx.c from the weight's `amx_from` rows on, else int8_gemm.c where the weight was prepared for it,
    the CPU has AVX-512 VNNI and x has at most INT8_KERNEL_ROWS rows, else torch._int_mm (`lib` defaults to
    the loaded kernels; a kernel that refuses leaves the rows to the next)."""
    lib = lib or cpu_native.library()
    xq, x_scale = quantized_rows(x, lib)
    rows = x.shape[0]
    if x.dtype in (torch.float32, torch.bfloat16) and lib is not None:
        amx = weight.amx_from is not None and rows >= weight.amx_from
        vnni = weight.row_sums is not None and rows <= INT8_KERNEL_ROWS
        if amx or vnni:
            out = torch.empty(rows, weight.out_features, dtype=x.dtype)
            b = None if bias is None else bias.to(torch.float32).contiguous()
            if amx and int8_amx.launch(lib, xq, x_scale, weight, b, out) == 0:
                return out
            if vnni and _vnni(lib, xq, x_scale, weight, b, out) == 0:
                return out
    y = torch._int_mm(xq, weight.qweight.t()).float()
    y = y.mul_(x_scale[:, None]).mul_(weight.scale[None, :])
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x.dtype)


def quantized_rows(x: torch.Tensor, lib) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize.quantize_activations(x), bit for bit: through int8_rows.c where `lib` has it (AVX-512) and x is
    bf16 or float32 on the CPU (one pass over x for its maxima and one for the quotients, where torch's six
    over float32 copies of x took longer than the AMX product at 256 rows), else through torch."""
    if lib is not None and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and x.dim() == 2:
        x = x.contiguous()
        xq, scale = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[0])
        if lib.matinee_quantize_rows(x.data_ptr(), int(x.dtype == torch.bfloat16), xq.data_ptr(), scale.data_ptr(),
                                     x.shape[0], x.shape[1], torch.get_num_threads()) == 0:
            return xq, scale
    return quantize_activations(x)


def _vnni(lib, xq: torch.Tensor, x_scale: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None,
          out: torch.Tensor) -> int:
    """int8_gemm.c into `out`; its status (-2 where the build has no AVX-512 VNNI)."""
    return lib.matinee_int8_gemm(xq.data_ptr(), x_scale.data_ptr(), weight.qweight.data_ptr(),
                                 weight.row_sums.data_ptr(), weight.scale.data_ptr(),
                                 None if bias is None else bias.data_ptr(), out.data_ptr(),
                                 int(out.dtype == torch.bfloat16), xq.shape[0], weight.out_features,
                                 weight.in_features, torch.get_num_threads())


def prepare_int4(weight: Int4Weight, dtype: torch.dtype) -> Int4CpuWeight:
    """Repack an Int4Weight once, at load, for activations of `dtype`."""
    if dtype not in INT4_DTYPES:
        raise ValueError(f"the CPU int4 matmul takes {INT4_DTYPES} activations, not {dtype}")
    if weight.group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"the CPU int4 matmul takes groups of {INT4_GROUP_SIZES}, not {weight.group_size}")
    n, k = weight.out_features, weight.in_features
    padded = -(-n // INT4_N_MULTIPLE) * INT4_N_MULTIPLE
    q = torch.zeros(padded, k, dtype=torch.int32)
    q[:n] = unpack_nibbles(weight.qweight).to(torch.int32)
    scale = torch.zeros(padded, k // weight.group_size)
    scale[:n] = weight.scale.float()
    zero = torch.full_like(scale, 8.0)
    if weight.zero is not None:
        zero[:n] = weight.zero.float()
    scale_and_offset = torch.stack([scale, (8.0 - zero) * scale], dim=-1).transpose(0, 1).contiguous()
    return Int4CpuWeight(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scale_and_offset.to(dtype),
                         weight.group_size, n, k, weight.order)


def int4_linear(x: torch.Tensor, weight: Int4CpuWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[M, K] @ weight.T (+ bias) -> [M, N] in x's dtype (the dtype the weight was prepared for)."""
    if x.dtype != weight.scale_and_offset.dtype:
        raise ValueError(f"this int4 weight was prepared for {weight.scale_and_offset.dtype} activations, "
                         f"not {x.dtype}")
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(in_order(x, weight.order).contiguous(), weight.packed, weight.group_size,
                                                   weight.scale_and_offset)[:, :weight.out_features]
    return y if bias is None else y + bias.to(x.dtype)


def linear(x: torch.Tensor, weight: Int8Weight | Int4CpuWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"quantized linear shapes do not match: {tuple(x.shape)} @ "
                         f"[{weight.out_features}, {weight.in_features}].T")
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias)
    return int4_linear(x, weight, bias)
