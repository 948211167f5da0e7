"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) and IQ4_XS for quant_gemm.c: the file's super-blocks decoded, repacked into
the kernel's 16-row groups and back, and the kernel's math in plain torch.

A K-quant row is super-blocks of 256 values (gguf.quants.Q4_K and its neighbours read them):
- Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles;
  w = d * sc[j] * q - dmin * m[j] for the 32 values of sub-block j. Byte l of the 32-byte chunk p
  holds value 64p + l in its low nibble and 64p + 32 + l in its high one.
- Q5_K (176): as Q4_K, with 32 bytes of fifth bits before the nibbles: bit j of byte l is value 32j + l's.
- Q6_K (210): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 values),
  fp16 d; w = d * sc[s] * (q - 32), q in 0..63.
- IQ4_XS (136): fp16 d, a uint16 of the eight 6-bit scales' high pairs, 4 bytes of their low nibbles, 128 bytes
  of nibbles; w = (d * (sc[j] - 32)) * LEVELS[q] for sub-block j, LEVELS llama.cpp's 16 non-uniform int8 values
  (kvalues_iq4nl). Byte 16j + l holds value 32j + l in its low nibble and 32j + 16 + l in its high one (a
  Q4_0 block's order, sub-block by sub-block).

The repacked group (one super-block of 16 rows, 16 x ROW_BYTES) keeps the file's bits, only its
scales widened to a byte each (Q4_K/Q5_K: 148 and 180 bytes a row against the file's 144 and 176; Q6_K
210, the same), laid out so one 4-byte broadcast of x meets 16 rows (see quant_gemm.c):
- Q4_K: d[16] fp16, dmin[16] fp16, sc[8][16] u8, m[8][16] u8, then [pair p][vector c][row][4]: the
  file's nibble byte 32p + 4c + k of each row. Q5_K adds [vector c][row][4] of the file's fifth-bit
  byte 4c + k.
- Q6_K: d[16] fp16, sc[16][16] int8, then per 32 values b: [vector c][row][4] bytes whose low nibble is
  column 32b + 4c + k's and high nibble 32b + 16 + 4c + k's, and [pair][row][4] bytes of high bits:
  bits 0-1, 2-3, 4-5 and 6-7 for columns 32b + 8i + k, 32b + 16 + 8i + k, 32b + 8i + 4 + k and
  32b + 16 + 8i + 4 + k.
- IQ4_XS: d[16] fp16, sc[8][16] int8 (the file's 6 bits less 32), then [sub-block j][vector c][row][4]: the
  file's nibble byte 16j + 4c + k of each row (138 bytes a row).

The product quantizes x as llama.cpp's block_q8_K: one float32 scale per super-block of 256 (amax / 127),
int8 values and their sums per 16. Within a super-block everything is integer: each sub-block's exact dot
product times its integer scale, added up (Q6_K: its unsigned values' products less 32 x sum(sc * sum(x))),
and Q4_K/Q5_K's sum of m * sum(x_q); then one float32 step per super-block, + dot * (d * d_x), and for
Q4_K/Q5_K - mins * (dmin * d_x): `reference_matmul` is that sequence, bit for bit. One float step per 256
values, not per 32, is what lets a K-quant weight byte cost what a Q4_0 one does.
"""
from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as GGMLType

QK_K = 256
GR = 16
Q4_K, Q5_K, Q6_K, IQ4_XS = GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_XS
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210, IQ4_XS: 136}   # a super-block of one row, as the file stores it
ROW_BYTES = {Q4_K: 148, Q5_K: 180, Q6_K: 210, IQ4_XS: 138}     # the same repacked
TYPES = tuple(BLOCK_BYTES)
# The 16 values an IQ4 nibble indexes (llama.cpp's kvalues_iq4nl; quant_layout.h's IQ4_LEVELS).
IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 of the little-endian float16."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes [..., 12] -> eight 6-bit scales and eight mins, uint8 [..., 8] each."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _pack_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The inverse of _scale_min."""
    return torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                      (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], dim=-1)


def _q6_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K file blocks [..., 210] -> the 256 unsigned 6-bit values [..., 256] (uint8, 0..63)."""
    ql = blocks[..., :128].reshape(*blocks.shape[:-1], 2, 64)
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32)
    low = torch.stack([ql & 0x0F, ql >> 4], dim=-2)                                  # [..., 2, 2, 64]
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(*low.shape)
    return (low | (high << 4)).reshape(*blocks.shape[:-1], QK_K)


def _q6_file(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The inverse of _q6_values with the scales (int8 bytes [..., 16]) and d (bytes [..., 2])."""
    halves = q.reshape(*q.shape[:-1], 2, 2, 64)
    ql = (halves[..., 0, :] & 0x0F) | ((halves[..., 1, :] & 0x0F) << 4)             # [..., 2, 64]
    high = (halves >> 4).reshape(*q.shape[:-1], 2, 4, 32)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    return torch.cat([ql.flatten(-2), qh.flatten(-2), sc, d], dim=-1)


def _iq4_scales(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS file blocks [..., 136] -> the eight scales less 32, int8 [..., 8]."""
    high = blocks[..., 2].int() | (blocks[..., 3].int() << 8)
    low = torch.stack([blocks[..., 4:8] & 0x0F, blocks[..., 4:8] >> 4], dim=-1).flatten(-2).int()   # j = 2i + odd
    return (low | (((high[..., None] >> (2 * torch.arange(8))) & 3) << 4)).sub(32).to(torch.int8)


def _iq4_scale_bytes(sc: torch.Tensor) -> torch.Tensor:
    """The inverse of _iq4_scales: int8 [..., 8] -> the file's scales_h (2 bytes) and scales_l (4), [..., 6]."""
    ls = sc.int() + 32
    high = ((ls >> 4) << (2 * torch.arange(8))).sum(dim=-1)
    low = (ls[..., 0::2] & 0x0F) | ((ls[..., 1::2] & 0x0F) << 4)
    return torch.cat([torch.stack([high & 0xFF, high >> 8], dim=-1), low], dim=-1).to(torch.uint8)


def decode(raw: torch.Tensor, qtype: int) -> dict[str, torch.Tensor]:
    """File rows uint8 [R, S * block bytes] -> the super-blocks' fields, values in column order:
    q uint8 [R, S, 256] (IQ4_XS: its levels, int8); d float32 [R, S]; Q4_K/Q5_K: dmin [R, S], sc and m uint8
    [R, S, 8]; Q6_K: sc int8 [R, S, 16]; IQ4_XS: sc int8 [R, S, 8] (less 32)."""
    blocks = raw.reshape(raw.shape[0], -1, BLOCK_BYTES[qtype])
    if qtype == IQ4_XS:
        qs = blocks[..., 8:].reshape(*blocks.shape[:2], 8, 1, 16)
        nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(*blocks.shape[:2], QK_K)
        return {"q": IQ4_LEVELS[nibbles.long()], "d": _f16(blocks[..., 0:2]), "sc": _iq4_scales(blocks)}
    if qtype == Q6_K:
        return {"q": _q6_values(blocks), "d": _f16(blocks[..., 208:210]),
                "sc": blocks[..., 192:208].contiguous().view(torch.int8)}
    sc, mn = _scale_min(blocks[..., 4:16])
    qs = blocks[..., -128:].reshape(*blocks.shape[:2], 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(*blocks.shape[:2], QK_K)
    if qtype == Q5_K:
        qh = blocks[..., 16:48].reshape(*blocks.shape[:2], 1, 32)
        q = q | ((torch.stack([(qh[..., 0, :] >> j) & 1 for j in range(8)], dim=-2).flatten(-2)) << 4)
    return {"q": q, "d": _f16(blocks[..., 0:2]), "dmin": _f16(blocks[..., 2:4]), "sc": sc, "m": mn}


def dequantize_raw(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """File rows -> float32 [R, S * 256], bit for bit as gguf.quants.dequantize gives them."""
    f = decode(raw, qtype)
    rows, supers = f["q"].shape[:2]
    if qtype == IQ4_XS:
        scale = (f["d"][..., None] * f["sc"].float())[..., None]                       # [R, S, 8, 1]
        return (scale * f["q"].reshape(rows, supers, 8, 32).float()).reshape(rows, -1)
    if qtype == Q6_K:
        scale = f["d"][..., None] * f["sc"].float()                                     # [R, S, 16]
        q = f["q"].reshape(rows, supers, 16, 16).float() - 32.0
        return (scale[..., None] * q).reshape(rows, -1)
    scale = (f["d"][..., None] * f["sc"].float())[..., None]
    low = (f["dmin"][..., None] * f["m"].float())[..., None]
    return (scale * f["q"].reshape(rows, supers, 8, 32).float() - low).reshape(rows, -1)


def check_rows(raw: torch.Tensor, qtype: int, cols: int) -> None:
    if cols % QK_K or raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] != cols // QK_K * BLOCK_BYTES[qtype]:
        raise ValueError(f"a {GGMLType(qtype).name} row of {cols} values is whole super-blocks of 256, "
                         f"{cols // QK_K * BLOCK_BYTES[qtype]} bytes, not {tuple(raw.shape)} {raw.dtype}")


def pack(raw: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """File rows [N, S * block bytes] -> uint8 [ceil(N/16), S, group bytes]; rows past N are zeros."""
    check_rows(raw, qtype, cols)
    n, supers, size = raw.shape[0], cols // QK_K, BLOCK_BYTES[qtype]
    groups = -(-n // GR)
    blocks = torch.zeros(groups * GR, supers, size, dtype=torch.uint8)
    blocks[:n] = raw.reshape(n, supers, size)
    b = blocks.view(groups, GR, supers, size).transpose(1, 2)                       # [G, S, 16, size]

    def lanes(t: torch.Tensor) -> torch.Tensor:   # [G, S, 16, k, ...] -> [G, S, k, ..., 16] flattened
        return t.movedim(2, -1).reshape(groups, supers, -1)

    def columns(t: torch.Tensor, vectors: int) -> torch.Tensor:   # [G, S, 16, vectors * 4] -> [v][row][4]
        return t.reshape(groups, supers, GR, vectors, 4).transpose(2, 3).reshape(groups, supers, -1)

    if qtype == IQ4_XS:
        parts = [b[..., 0:2].reshape(groups, supers, -1), lanes(_iq4_scales(b).view(torch.uint8)),
                 columns(b[..., 8:], 32)]                                          # [j * 4 + c][row][4]
    elif qtype == Q6_K:
        q = _q6_values(b)                                                          # [G, S, 16, 256]
        x = q.reshape(groups, supers, GR, 8, 2, 4, 4)                               # [.., b, half, c, k]
        ql = (x[..., 0, :, :] & 0x0F) | ((x[..., 1, :, :] & 0x0F) << 4)             # [G, S, 16, 8, 4, 4]
        hi = (x >> 4).reshape(groups, supers, GR, 8, 2, 2, 2, 4)                    # [.., b, half, pair, odd, k]
        qh = hi[..., 0, :, 0, :] | (hi[..., 1, :, 0, :] << 2) | (hi[..., 0, :, 1, :] << 4) | (hi[..., 1, :, 1, :] << 6)
        parts = [b[..., 208:210].reshape(groups, supers, GR, 2).reshape(groups, supers, -1),
                 lanes(b[..., 192:208]),
                 ql.permute(0, 1, 3, 4, 2, 5).reshape(groups, supers, -1),          # [b][c][row][4]
                 qh.permute(0, 1, 3, 4, 2, 5).reshape(groups, supers, -1)]          # [b][pair][row][4]
    else:
        sc, mn = _scale_min(b[..., 4:16])
        parts = [b[..., 0:2].reshape(groups, supers, -1), b[..., 2:4].reshape(groups, supers, -1),
                 lanes(sc), lanes(mn), columns(b[..., -128:], 32)]                  # [p * 8 + c][row][4]
        if qtype == Q5_K:
            parts.append(columns(b[..., 16:48], 8))
    return torch.cat(parts, dim=-1).contiguous()


def unpack(packed: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [G, S, group bytes] -> the file's rows [G * 16, S * block bytes] (padding rows included)."""
    groups, supers, _ = packed.shape

    def rows(t: torch.Tensor, k: int) -> torch.Tensor:   # [G, S, k * 16] lanes last -> [G, S, 16, k]
        return t.reshape(groups, supers, k, GR).transpose(2, 3)

    def columns(t: torch.Tensor, vectors: int) -> torch.Tensor:
        return t.reshape(groups, supers, vectors, GR, 4).transpose(2, 3).reshape(groups, supers, GR, -1)

    if qtype == IQ4_XS:
        d, sc = packed[..., :32].reshape(groups, supers, GR, 2), rows(packed[..., 32:160], 8).view(torch.int8)
        blocks = torch.cat([d, _iq4_scale_bytes(sc), columns(packed[..., 160:], 32)], dim=-1)
    elif qtype == Q6_K:
        d = packed[..., :32].reshape(groups, supers, GR, 2)
        sc = rows(packed[..., 32:288], 16)
        ql = packed[..., 288:2336].reshape(groups, supers, 8, 4, GR, 4).permute(0, 1, 4, 2, 3, 5)  # [.., 16, b, c, k]
        qh = packed[..., 2336:].reshape(groups, supers, 8, 2, GR, 4).permute(0, 1, 4, 2, 3, 5)   # [.., 16, b, pair, k]
        high = torch.stack([torch.stack([qh & 3, (qh >> 4) & 3], dim=-2),
                            torch.stack([(qh >> 2) & 3, (qh >> 6) & 3], dim=-2)], dim=-4)  # [.., b, half, pair, odd, k]
        high = high.reshape(groups, supers, GR, 8, 2, 16)
        low = torch.stack([ql & 0x0F, ql >> 4], dim=-3).reshape(groups, supers, GR, 8, 2, 16)
        q = (low | (high << 4)).reshape(groups, supers, GR, QK_K)
        blocks = _q6_file(q, sc, d)
    else:
        d, dmin = packed[..., :32].reshape(groups, supers, GR, 2), packed[..., 32:64].reshape(groups, supers, GR, 2)
        sc, mn = rows(packed[..., 64:192], 8), rows(packed[..., 192:320], 8)
        qs = columns(packed[..., 320:2368], 32)
        parts = [d, dmin, _pack_scale_min(sc, mn)]
        if qtype == Q5_K:
            parts.append(columns(packed[..., 2368:], 8))
        blocks = torch.cat(parts + [qs], dim=-1)
    return blocks.transpose(1, 2).reshape(groups * GR, -1).contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 values as float32 [M, S, 256], scales [M, S], sums per 16 values [M, S, 16]), as
    quant_gemm.c quantizes a K-quant's rows: scale amax / 127 per super-block, values x * (1 / scale) rounded
    to nearest even."""
    blocks = x.float().reshape(x.shape[0], -1, QK_K)
    scale = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse[..., None])
    return q, scale, q.reshape(*q.shape[:2], 16, 16).sum(dim=-1)


def reference_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """x [M, K] @ the K-quant rows `raw` [n, ...].T in quant_gemm.c's sequence, float32 [M, n]: each super-block's
    integer sums are exact (float64 holds them), then rounded to float32 and scaled as the kernel does."""
    f = decode(raw, qtype)
    supers = f["q"].shape[1]
    sub = 16 if qtype == Q6_K else 32                                   # values per integer scale
    q = f["q"].double().reshape(n, supers, -1, sub)                     # [N, S, 256 / sub, sub] (IQ4_XS: levels)
    if qtype == Q6_K:
        q = q - 32.0
    sc = f["sc"].double()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    step = max(1, (1 << 24) // max(1, n * supers * (QK_K // sub)))
    for start in range(0, x.shape[0], step):
        xq, xd, xs = quantize_rows(x[start:start + step])
        xq = xq.double().reshape(xq.shape[0], supers, -1, sub)
        dots = (torch.einsum("msjk,nsjk->mnsj", xq, q) * sc[None]).sum(dim=-1)       # [m, N, S]
        mins = None
        if "m" in f:
            sums = xs.double().reshape(xs.shape[0], supers, 8, 2).sum(dim=-1)         # [m, S, 8] per 32
            mins = (sums[:, None] * f["m"].double()[None]).sum(dim=-1).float()        # [m, N, S]
        dots = dots.float()
        y = torch.zeros(xq.shape[0], n)
        for s in range(supers):
            y = y + dots[:, :, s] * (f["d"][None, :, s] * xd[:, None, s])
            if mins is not None:
                y = y - mins[:, :, s] * (f["dmin"][None, :, s] * xd[:, None, s])
        out[start:start + step] = y
    return out
