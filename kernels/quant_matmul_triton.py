"""W8A16 and W4A16 matmuls as one Triton kernel that dequantizes each weight tile in registers.

x[M, K] (float16, bfloat16 or float32) @ w.T, w read in its quantized layout (quantize.py):
Int8Weight (per-channel scale applied to the accumulator), Int4Weight (nibbles, float16 group
scales, optional zero points) and GGUFWeight (Q8_0, Q4_0, Q4_1 rows read straight from the
`gguf` bytes: the block's fp16 scale and min through a float16 view of the same buffer). Each
weight tile is dequantized to float32 (every byte and scale loaded once, spread over its
elements by tl.join and reshapes), cast to x's dtype and multiplied with tl.dot; products
accumulate in float32. Decode has few rows, so when the output tiles cannot fill the GPU, K is
split between programs whose float32 partials torch sums (deterministic, unlike atomics).
Reference: quant_matmul.py.
"""

import torch
import triton
import triton.language as tl

from kernels.quantize import GGUF_BLOCK_BYTES, GGMLType, GGUFWeight, Int4Weight, Int8Weight, in_order

# Weight formats, the kernel's FORMAT.
INT8, INT4, Q8_0, Q4_0, Q4_1 = (tl.constexpr(f) for f in range(5))
_GGUF_FORMAT = {GGMLType.Q8_0: Q8_0, GGMLType.Q4_0: Q4_0, GGMLType.Q4_1: Q4_1}
BLOCK_N, BLOCK_K = 64, 64   # an int4 group divides BLOCK_K or is a multiple of it
PROGRAMS_PER_SM = 4
MAX_SPLITS = 16


@triton.jit
def _quant_matmul_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_om, stride_split,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_TILE: tl.constexpr, HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_BYTES: tl.constexpr, QUANTS_AT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok = rows < M
    col_ok = cols < N
    # Weight rows in int64: N times a row's bytes overflows int32 on an LM head.
    w_row = cols.to(tl.int64)[:, None]
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # The weight tile is [BLOCK_N, BLOCK_K]: output channels down, inputs across, as stored.
        # Each byte and each scale is loaded once, then spread over its elements by reshapes.
        if FORMAT == INT8:  # the per-channel scale is applied to the accumulator below
            w = tl.load(q_ptr + w_row * stride_qn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                        other=0).to(tl.float32)
        elif FORMAT == INT4:  # byte j holds element 2j (low nibble) and 2j + 1 (high)
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            byte = tl.load(q_ptr + w_row * stride_qn + j[None, :], mask=col_ok[:, None] & (2 * j < k_hi)[None, :],
                           other=0).to(tl.int32)
            q = tl.join(byte & 0xF, byte >> 4).reshape(BLOCK_N, GROUPS_PER_TILE, BLOCK_K // GROUPS_PER_TILE)
            q = q.to(tl.float32)
            g = k0 // GROUP + tl.arange(0, GROUPS_PER_TILE)
            g_mask = col_ok[:, None] & (g * GROUP < k_hi)[None, :]
            scale = tl.load(s_ptr + w_row * stride_sn + g[None, :], mask=g_mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                q -= tl.load(z_ptr + w_row * stride_sn + g[None, :], mask=g_mask, other=0).to(tl.float32)[:, :, None]
            else:
                q -= 8.0
            w = (q * scale[:, :, None]).reshape(BLOCK_N, BLOCK_K)
        else:  # GGUF: s_ptr and z_ptr are float16 and int8 views of the bytes at q_ptr
            blocks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            block_mask = col_ok[:, None] & (blocks * 32 < k_hi)[None, :]
            first = w_row * stride_qn + blocks[None, :] * BLOCK_BYTES      # [BLOCK_N, blocks]: a block's byte 0
            d = tl.load(s_ptr + first // 2, mask=block_mask, other=0.0).to(tl.float32)[:, :, None]
            if FORMAT == Q8_0:
                e = tl.arange(0, 32)[None, None, :]
                w = tl.load(z_ptr + first[:, :, None] + QUANTS_AT + e, mask=block_mask[:, :, None],
                            other=0).to(tl.float32) * d
            else:
                # Byte j of a Q4 block holds element j (low nibble) and element j + 16 (high).
                j = tl.arange(0, 16)[None, None, :]
                byte = tl.load(q_ptr + first[:, :, None] + QUANTS_AT + j, mask=block_mask[:, :, None],
                               other=0).to(tl.int32)
                q = tl.permute(tl.join(byte & 0xF, byte >> 4), (0, 1, 3, 2))
                q = q.reshape(BLOCK_N, BLOCK_K // 32, 32).to(tl.float32)
                if FORMAT == Q4_0:
                    w = (q - 8.0) * d
                else:
                    w = q * d + tl.load(s_ptr + first // 2 + 1, mask=block_mask, other=0.0).to(tl.float32)[:, :, None]
            w = w.reshape(BLOCK_N, BLOCK_K)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)

    if FORMAT == INT8:
        acc *= tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        if split == 0:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split.to(tl.int64) * stride_split + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def choose_num_splits(tiles: int, k_tiles: int, device: torch.device) -> int:
    """Split K only where the output tiles leave most of the GPU idle (decode's few rows)."""
    if device.type != "cuda":
        return 1
    programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, k_tiles, programs // tiles))


def linear(x: torch.Tensor, weight: Int8Weight | Int4Weight | GGUFWeight, bias: torch.Tensor | None = None,
           num_splits: int | None = None) -> torch.Tensor:
    """x[M, K] @ w.T (+ bias) -> [M, N] in x's dtype; num_splits forces the split-K path (None: heuristic)."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"quantized linear shapes do not match: {tuple(x.shape)} @ "
                         f"[{weight.out_features}, {weight.in_features}].T")
    if isinstance(weight, Int4Weight):
        x = in_order(x, weight.order)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.out_features
    if m == 0 or n == 0:
        return torch.zeros((m, n), dtype=x.dtype, device=x.device)
    has_zero, group, block_bytes, quants_at = False, BLOCK_K, 0, 0
    if isinstance(weight, Int8Weight):
        fmt, q, s, z, stride_sn = INT8, weight.qweight, weight.scale, weight.qweight, 0
    elif isinstance(weight, Int4Weight):
        fmt, q, s, group, stride_sn = INT4, weight.qweight, weight.scale, weight.group_size, weight.scale.stride(0)
        has_zero = weight.zero is not None
        z = weight.zero if has_zero else q
        if BLOCK_K % group and group % BLOCK_K:
            raise ValueError(f"int4 groups of {group} neither divide nor are a multiple of {BLOCK_K}, "
                             "the kernel's tile")
    else:
        # The fp16 view needs the rows to start on even bytes, true of whole 34/18/20-byte blocks.
        q = weight.raw.contiguous()
        fmt, s, z, stride_sn = _GGUF_FORMAT[weight.qtype], q.view(torch.float16), q.view(torch.int8), 0
        block_bytes = GGUF_BLOCK_BYTES[weight.qtype]
        quants_at = 4 if weight.qtype == GGMLType.Q4_1 else 2
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, BLOCK_N)
    k_tiles = triton.cdiv(k, BLOCK_K)
    splits = num_splits or choose_num_splits(tiles, k_tiles, x.device)
    k_per_split = triton.cdiv(k_tiles, splits) * BLOCK_K
    splits = triton.cdiv(k, k_per_split)   # no empty splits
    out = torch.empty((splits, m, n) if splits > 1 else (m, n),
                      dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    _quant_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N), splits)](
        x, q, s, z, bias if bias is not None else x, out,
        m, n, k, k_per_split,
        x.stride(0), q.stride(0), stride_sn, n, m * n,
        FORMAT=fmt, GROUP=group, GROUPS_PER_TILE=max(1, BLOCK_K // group), HAS_ZERO=has_zero,
        HAS_BIAS=bias is not None,
        BLOCK_BYTES=block_bytes, QUANTS_AT=quants_at,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )
    return out if splits == 1 else out.sum(0).to(x.dtype)
