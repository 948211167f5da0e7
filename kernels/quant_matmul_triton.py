"""W8A16 and W4A16 matmuls as one Triton kernel that dequantizes each weight tile in registers.

x[M, K] (float16, bfloat16 or float32) @ w.T, w read in its quantized layout (quantize.py):
Int8Weight (per-channel scale applied to the accumulator), Int4Weight (nibbles, float16 group
scales, optional zero points) and GGUFWeight (Q8_0, Q4_0, Q4_1 rows read straight from the
`gguf` bytes: the block's fp16 scale and min through a float16 view of the same buffer). Each
weight tile is dequantized to float32, cast to x's dtype and multiplied with tl.dot; products
accumulate in float32. Decode has few rows, so when the output tiles cannot fill the GPU, K is
split between programs whose float32 partials torch sums (deterministic, unlike atomics).
Reference: quant_matmul.py.
"""

import torch
import triton
import triton.language as tl

from kernels.quantize import GGUF_BLOCK_BYTES, GGMLType, GGUFWeight, Int4Weight, Int8Weight

# Weight formats, the kernel's FORMAT.
INT8, INT4, Q8_0, Q4_0, Q4_1 = range(5)
_GGUF_FORMAT = {GGMLType.Q8_0: Q8_0, GGMLType.Q4_0: Q4_0, GGMLType.Q4_1: Q4_1}
BLOCK_N, BLOCK_K = 64, 64
PROGRAMS_PER_SM = 4
MAX_SPLITS = 16


@triton.jit
def _quant_matmul_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_om, stride_split,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_BYTES: tl.constexpr, QUANTS_AT: tl.constexpr,
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
        w_mask = col_ok[:, None] & k_ok[None, :]
        k = ks[None, :]
        if FORMAT == 0:  # INT8: the per-channel scale is applied to the accumulator below
            w = tl.load(q_ptr + w_row * stride_qn + k, mask=w_mask, other=0).to(tl.float32)
        elif FORMAT == 1:  # INT4: byte k // 2, low nibble for even k
            byte = tl.load(q_ptr + w_row * stride_qn + k // 2, mask=w_mask, other=0).to(tl.int32)
            q = ((byte >> ((k % 2) * 4)) & 0xF).to(tl.float32)
            group = w_row * stride_sn + k // GROUP
            scale = tl.load(s_ptr + group, mask=w_mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                zero = tl.load(z_ptr + group, mask=w_mask, other=0).to(tl.float32)
            else:
                zero = 8.0
            w = (q - zero) * scale
        else:  # GGUF: s_ptr and z_ptr are float16 and int8 views of the bytes at q_ptr
            block = w_row * stride_qn + (k // 32) * BLOCK_BYTES   # its first byte
            within = k % 32
            d = tl.load(s_ptr + block // 2, mask=w_mask, other=0.0).to(tl.float32)
            if FORMAT == 2:
                w = tl.load(z_ptr + block + QUANTS_AT + within, mask=w_mask, other=0).to(tl.float32) * d
            else:
                # Byte j of a Q4 block holds element j (low nibble) and element j + 16 (high).
                byte = tl.load(q_ptr + block + QUANTS_AT + within % 16, mask=w_mask, other=0).to(tl.int32)
                q = ((byte >> ((within // 16) * 4)) & 0xF).to(tl.float32)
                if FORMAT == 3:
                    w = (q - 8.0) * d
                else:
                    w = q * d + tl.load(s_ptr + block // 2 + 1, mask=w_mask, other=0.0).to(tl.float32)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)

    if FORMAT == 0:
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
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.out_features
    if m == 0 or n == 0:
        return torch.zeros((m, n), dtype=x.dtype, device=x.device)
    has_zero, group, block_bytes, quants_at = False, 1, 0, 0
    if isinstance(weight, Int8Weight):
        fmt, q, s, z, stride_sn = INT8, weight.qweight, weight.scale, weight.qweight, 0
    elif isinstance(weight, Int4Weight):
        fmt, q, s, group, stride_sn = INT4, weight.qweight, weight.scale, weight.group_size, weight.scale.stride(0)
        has_zero = weight.zero is not None
        z = weight.zero if has_zero else q
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
        FORMAT=fmt, GROUP=group, HAS_ZERO=has_zero, HAS_BIAS=bias is not None,
        BLOCK_BYTES=block_bytes, QUANTS_AT=quants_at,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )
    return out if splits == 1 else out.sum(0).to(x.dtype)
