"""GGUF-quantized projections on the CPU: quant_gemm.c's launcher, its weight layout, and the torch
reference of the same math.

A weight stays in its file's block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, and the K-quants Q4_K,
Q5_K, Q6_K and IQ4_XS of kquant.py), repacked once at load into groups of 16 output rows (see quant_gemm.c);
nothing is widened to float in memory. The product quantizes x
per block of 32 to int8 (one float32 scale, amax / 127, rounded to nearest even; per super-block of 256
for the K-quants, see kquant.py) and sums exact int32 block products scaled in float32, as llama.cpp does: `reference_matmul` is that math in plain
torch, what the torch backend serves a quantized weight with and what the tests hold the kernel to.
A tied embedding reads its rows out of the quantized LM head, so the model keeps one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_native, kquant, linear
from kernels.quantize import GGUF_BLOCK as QK, GGUF_BLOCK_BYTES, GGMLType

GR = 16                             # output rows per packed group
Q4_0, Q4_1, Q8_0 = GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0   # ggml's type numbers, as GGUF stores them
Q5_0, Q5_1, IQ4_NL = GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.IQ4_NL
# Q5_0 and Q5_1 blocks: d [, m], then qh (the 32 fifth bits, a little-endian uint32), then Q4's 16 bytes of nibbles;
# IQ4_NL: d, then Q4_0's nibbles, each an index into kquant.IQ4_LEVELS.
BLOCK_BYTES = {**GGUF_BLOCK_BYTES, Q5_0: 22, Q5_1: 24, IQ4_NL: 18}
NAMES = {qtype: qtype.name for qtype in (*BLOCK_BYTES, *kquant.TYPES)}
_HEAD = {Q4_0: 1, Q4_1: 2, Q5_0: 1, Q5_1: 2, Q8_0: 1, IQ4_NL: 1}      # float16 scales per row and block (d [, m])
_VECTORS = {Q4_0: 4, Q4_1: 4, Q5_0: 5, Q5_1: 5, Q8_0: 8, IQ4_NL: 4}   # 4-byte columns per row and block (Q5: qh first)
_MIN = (Q4_1, Q5_1)                                         # the types with a minimum m


@dataclass(frozen=True)
class QuantTensor:
    """A matmul weight as the file stores it: `raw` is uint8 [rows, row_bytes] of `qtype` blocks."""
    qtype: int
    raw: torch.Tensor
    cols: int

    @staticmethod
    def cat(parts: list[QuantTensor]) -> QuantTensor | None:
        """Row blocks stacked (q, k and v fused), or None where their types or widths differ."""
        if len({(p.qtype, p.cols) for p in parts}) != 1:
            return None
        return QuantTensor(parts[0].qtype, torch.cat([p.raw for p in parts]), parts[0].cols)


class QuantWeight:
    """A [N, K] weight of `qtype` as quant_gemm.c reads it: `packed` is uint8 [ceil(N/16), K/32, group bytes].
    `dtype` is the activation dtype its products and embedding rows come out in; `amx_from` the row
    count from which the CPU backend multiplies bf16 rows by it on AMX (quant_amx.py), None for never."""

    def __init__(self, packed: torch.Tensor, qtype: int, out_features: int, in_features: int,
                 dtype: torch.dtype) -> None:
        self.packed, self.qtype, self.out_features, self.in_features = packed, qtype, out_features, in_features
        self.dtype = dtype
        self.amx_from: int | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    @property
    def name(self) -> str:
        return NAMES[self.qtype]

    def numel(self) -> int:
        return self.out_features * self.in_features


class QuantStack:
    """Quantized projections fused by rows whose stored types differ (a K-quant mix stores q and k in
    Q4_K, v in Q6_K): one weight to the model, one kernel call per part, each part packed as its file
    stores it."""

    def __init__(self, parts: list[QuantWeight]) -> None:
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("projections to stack take the same inputs")
        self.parts = parts
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features
        self.dtype = parts[0].dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def numel(self) -> int:
        return self.out_features * self.in_features


QUANTIZED = (QuantWeight, QuantStack)   # what the quantized matmuls below take


def stack(parts: list[QuantWeight]) -> QuantWeight | QuantStack:
    return parts[0] if len(parts) == 1 else QuantStack(parts)


def supported(qtype: int) -> bool:
    return qtype in NAMES


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """File rows [n, k / block * block bytes] of random bytes but for every float16 scale (d, and m or dmin),
    a small fixed one: to time a kernel, whose speed does not depend on the values (random scale bytes
    would hold infinities and NaNs)."""
    qtype = GGMLType(int(qtype))
    block, size = (kquant.QK_K, kquant.BLOCK_BYTES[qtype]) if qtype in kquant.TYPES else (QK, BLOCK_BYTES[qtype])
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8, generator=gen)
    scale = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8)
    at = [208] if qtype == kquant.Q6_K else [0, 2] if qtype in (*_MIN, kquant.Q4_K, kquant.Q5_K) else [0]
    for offset in at:
        blocks[:, offset:offset + 2] = scale
    return blocks.reshape(n, -1)


def pack(tensor: QuantTensor, dtype: torch.dtype = torch.float32) -> QuantWeight:
    """The file's rows -> groups of 16 rows per block; rows past N (to a whole group) are zeros."""
    qtype, raw, k = tensor.qtype, tensor.raw, tensor.cols
    if not supported(qtype):
        raise ValueError(f"no quantized kernel reads GGML type {qtype}")
    if qtype in kquant.TYPES:
        return QuantWeight(kquant.pack(raw, qtype, k), qtype, raw.shape[0], k, dtype)
    n, nb, size = raw.shape[0], k // QK, BLOCK_BYTES[qtype]
    if k % QK or raw.shape[1] != nb * size:
        raise ValueError(f"a {NAMES[qtype]} row of {k} values is {nb * size} bytes, not {raw.shape[1]}")
    groups = -(-n // GR)
    blocks = torch.zeros(groups * GR, nb, size, dtype=torch.uint8)
    blocks[:n] = raw.reshape(n, nb, size)
    blocks = blocks.view(groups, GR, nb, size).transpose(1, 2)          # [G, nb, 16, size]
    head = 2 * _HEAD[qtype]
    scales = blocks[..., :head].reshape(groups, nb, GR, _HEAD[qtype], 2).transpose(2, 3)   # [G, nb, d|m, 16, 2]
    values = blocks[..., head:].reshape(groups, nb, GR, _VECTORS[qtype], 4).transpose(2, 3)  # [G, nb, v, 16, 4]
    packed = torch.cat([scales.reshape(groups, nb, -1), values.reshape(groups, nb, -1)], dim=-1).contiguous()
    return QuantWeight(packed, qtype, n, k, dtype)


def unpack(weight: QuantWeight) -> torch.Tensor:
    """The file's rows back (uint8 [N, row_bytes])."""
    qtype, (groups, nb, _) = weight.qtype, weight.packed.shape
    if qtype in kquant.TYPES:
        return kquant.unpack(weight.packed, qtype)[:weight.out_features].contiguous()
    head = 2 * _HEAD[qtype]
    scales = weight.packed[..., :head * GR].reshape(groups, nb, _HEAD[qtype], GR, 2).transpose(2, 3)
    values = weight.packed[..., head * GR:].reshape(groups, nb, _VECTORS[qtype], GR, 4).transpose(2, 3)
    blocks = torch.cat([scales.reshape(groups, nb, GR, -1), values.reshape(groups, nb, GR, -1)], dim=-1)
    return blocks.transpose(1, 2).reshape(groups * GR, -1)[:weight.out_features].contiguous()


def _parts(weight: QuantWeight, rows: torch.Tensor | None = None):
    """(values [R, nb, 32] as float32, d [R, nb], m [R, nb] or None) of output rows `rows` (all by
    default), the values as the integers the kernel multiplies (Q4_0's already less 8, Q5_0's less 16, IQ4_NL's
    levels)."""
    qtype, (groups, nb, _) = weight.qtype, weight.packed.shape
    heads, head = _HEAD[qtype], 2 * _HEAD[qtype] * GR
    scales = weight.packed[..., :head].view(torch.float16).view(groups, nb, heads, GR)
    values = weight.packed[..., head:].view(groups, nb, _VECTORS[qtype], GR, 4)
    if rows is None:
        rows = torch.arange(weight.out_features)
    group, lane = rows // GR, rows % GR
    scales = scales[group, :, :, lane].float()                                    # [R, nb, heads]
    values = values[group, :, :, lane, :].reshape(rows.shape[0], nb, -1)          # [R, nb, 4 * vectors]
    if qtype == Q8_0:
        q = values.view(torch.int8).float()
    else:   # byte j: column j in its low nibble, column 16 + j in its high one
        qh = None
        if qtype in (Q5_0, Q5_1):   # bit j of qh: column j's fifth bit
            qh, values = values[..., :4].to(torch.int64), values[..., 4:]
            qh = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
        q = torch.cat([values & 0x0F, values >> 4], dim=-1)
        q = kquant.IQ4_LEVELS[q.long()].float() if qtype == IQ4_NL else q.float()
        if qh is not None:
            q = q + 16.0 * ((qh[..., None] >> torch.arange(QK)) & 1).float()
        if qtype in (Q4_0, Q5_0):
            q = q - (8.0 if qtype == Q4_0 else 16.0)
    return q, scales[..., 0], scales[..., 1] if qtype in _MIN else None


def dequantize(weight: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, K] of output rows `rows`, bit for bit as gguf.quants.dequantize gives them."""
    if weight.qtype in kquant.TYPES:
        if rows is None:
            return kquant.dequantize_raw(unpack(weight), weight.qtype)
        picked = kquant.unpack(weight.packed[rows // GR], weight.qtype).view(rows.shape[0], GR, -1)
        return kquant.dequantize_raw(picked[torch.arange(rows.shape[0]), rows % GR], weight.qtype)
    q, d, m = _parts(weight, rows)
    out = d[..., None] * q if m is None else d[..., None] * q + m[..., None]
    return out.reshape(q.shape[0], -1)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 values as float32 [M, K/32, 32], scales [M, K/32], sums [M, K/32]), as quant_gemm.c
    quantizes its rows: scale amax / 127, values x * (1 / scale) rounded to nearest even."""
    blocks = x.float().reshape(x.shape[0], -1, QK)
    scale = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse[..., None])
    return q, scale, q.sum(dim=-1)


def reference_matmul(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """quant_gemm.c's math in plain torch, bit for bit: per block, exact integer dot products (float32
    holds them exactly: at most 32 * 127 * 128) times d_w * d_x, plus Q4_1's and Q5_1's m_w * (d_x * sum(x)),
    added to the output block after block."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"quantized linear shapes do not match: {tuple(x.shape)} @ {tuple(weight.shape)}.T")
    if isinstance(weight, QuantStack):
        return stacked(x, weight, bias, reference_matmul)
    if weight.qtype in kquant.TYPES:
        out = kquant.reference_matmul(x, unpack(weight), weight.qtype, weight.out_features)
        return (out if bias is None else out + bias.float()).to(x.dtype)
    q, d, m = _parts(weight)
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    step = max(1, (1 << 24) // max(1, weight.out_features * q.shape[1]))   # rows at a time: bounded memory
    for start in range(0, x.shape[0], step):
        xq, xd, xs = quantize_rows(x[start:start + step])
        dots = torch.einsum("mbk,nbk->mnb", xq, q)
        y = torch.zeros(xq.shape[0], weight.out_features)
        for b in range(q.shape[1]):
            y = y + dots[:, :, b] * (d[None, :, b] * xd[:, None, b])
            if m is not None:
                y = y + m[None, :, b] * (xd[:, b] * xs[:, b])[:, None]
        out[start:start + step] = y
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def matmul(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """x[M, K] (bf16 or float32) @ weight.T (+ bias) -> [M, N] in x's dtype, through quant_gemm.c; `lib`
    defaults to the loaded kernels (a test passes another build)."""
    if isinstance(weight, QuantStack):
        return stacked(x, weight, bias, lambda x, part, bias: matmul(x, part, bias, lib))

    def launch(lib, x, bias, out, bf16):
        return lib.matinee_quant_gemm(x.data_ptr(), bf16, weight.qtype, weight.packed.data_ptr(),
                                      None if bias is None else bias.data_ptr(), out.data_ptr(), bf16,
                                      x.shape[0], weight.out_features, weight.in_features, torch.get_num_threads())
    return cpu_native.projection(x, weight, bias, lib, "quantized linear", "int8", launch)


def stacked(x: torch.Tensor, weight: QuantStack, bias: torch.Tensor | None, product) -> torch.Tensor:
    """`product(x, part, bias)` of each part, side by side."""
    outs, start = [], 0
    for part in weight.parts:
        end = start + part.out_features
        outs.append(product(x, part, None if bias is None else bias[start:end]))
        start = end
    return torch.cat(outs, dim=1)


def embedding(ids: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """Rows `ids` of the weight, dequantized, in the weight's activation dtype (as F.embedding would give
    them from the dequantized table): through quant_gemm.c where it is loaded (the same bits; a Q6_K token's
    row took 0.8 ms of a 1B model's 25-29 ms decode step through torch's ops), else `dequantize`."""
    lib = cpu_native.library()
    if lib is not None and weight.packed.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16):
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.shape[0], weight.in_features, dtype=weight.dtype)
        status = lib.matinee_quant_rows(int(weight.qtype), weight.packed.data_ptr(), weight.out_features,
                                        weight.in_features, flat.data_ptr(), flat.shape[0], out.data_ptr(),
                                        int(weight.dtype == torch.bfloat16))
        if status == -4:
            raise IndexError(f"token id out of range [0, {weight.out_features})")
        if status != 0:
            raise ValueError(f"quant_gemm.c does not read rows of type {weight.qtype}")
        return out.reshape(*ids.shape, weight.in_features)
    if ids.numel():
        low, high = torch.aminmax(ids)
        if low < 0 or high >= weight.out_features:
            raise IndexError(f"token id out of range [0, {weight.out_features})")
    return dequantize(weight, ids.reshape(-1)).to(weight.dtype).reshape(*ids.shape, weight.in_features)


def torch_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch backend's projection: the reference for a quantized weight, else linear.linear."""
    if isinstance(weight, QUANTIZED):
        return reference_matmul(x, weight, bias)
    return linear.linear(x, weight, bias)


def torch_embedding(ids: torch.Tensor, weight) -> torch.Tensor:
    return embedding(ids, weight) if isinstance(weight, QuantWeight) else F.embedding(ids, weight)
