"""A small reference quantizer to GGUF's K-quants (Q4_K, Q5_K, Q6_K) and IQ4 types (IQ4_NL, IQ4_XS) for the
tests: the `gguf` package dequantizes these types but cannot quantize to them (gguf.quants raises
NotImplementedError).

It writes the bytes as llama.cpp's quantize_row_q*_K_ref lays them out, with a plain min/max choice of
scales in place of llama.cpp's search: the tests need valid blocks, not the best ones. It shares no code
with kernels/kquant.py, and the gguf package's dequantizer is the judge of both.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType as Q

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _q45(w: np.ndarray, bits: int) -> list[np.ndarray]:
    """Super-blocks [S, 256] -> (d, dmin, sc [S, 8], m [S, 8], q [S, 256]) for Q4_K (4 bits) or Q5_K (5)."""
    sub = w.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / (2 ** bits - 1)
    d = _f16(scale.max(-1) / 63).astype(np.float32)
    dmin = _f16(-lo.min(-1) / 63).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), 0, 63)
    m = np.clip(np.round(np.divide(-lo, dmin[:, None], out=np.zeros_like(lo), where=dmin[:, None] > 0)), 0, 63)
    step = (d[:, None] * sc)[..., None]
    q = np.divide(sub + (dmin[:, None] * m)[..., None], step, out=np.zeros_like(sub), where=step > 0)
    q = np.clip(np.round(q), 0, 2 ** bits - 1).astype(np.uint8).reshape(-1, QK_K)
    return [d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q]


def _scales12(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    out = np.zeros((sc.shape[0], 12), np.uint8)
    for j in range(8):
        if j < 4:
            out[:, j] = sc[:, j]
            out[:, j + 4] = m[:, j]
        else:
            out[:, j + 4] = (sc[:, j] & 0xF) | ((m[:, j] & 0xF) << 4)
            out[:, j - 4] |= (sc[:, j] >> 4) << 6
            out[:, j] |= (m[:, j] >> 4) << 6
    return out


def _nibbles(q: np.ndarray) -> np.ndarray:
    qs = np.zeros((q.shape[0], 128), np.uint8)
    for p in range(4):
        for l in range(32):
            qs[:, 32 * p + l] = (q[:, 64 * p + l] & 0xF) | ((q[:, 64 * p + 32 + l] & 0xF) << 4)
    return qs


def _q6(w: np.ndarray) -> np.ndarray:
    sub = w.reshape(-1, 16, 16)
    # Every other sub-block's scale negative, so both signs of the int8 scales (and q - 32 = -32) occur.
    scale = np.abs(sub).max(-1) / 31.5 * np.where(np.arange(16) % 2, -1.0, 1.0)
    d = _f16(np.abs(scale).max(-1) / 127).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), -128, 127)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)), -32, 31)
    L = (q + 32).astype(np.uint8).reshape(-1, QK_K)
    ql, qh = np.zeros((L.shape[0], 128), np.uint8), np.zeros((L.shape[0], 64), np.uint8)
    for n in (0, 128):
        for l in range(32):
            q1, q2, q3, q4 = L[:, n + l], L[:, n + l + 32], L[:, n + l + 64], L[:, n + l + 96]
            ql[:, n // 2 + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            ql[:, n // 2 + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            qh[:, n // 4 + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d).view(np.uint8).reshape(-1, 2)], 1)


IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _iq4_nibbles(sub: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Blocks of 32 [..., 32] and their steps [...] -> the nearest level's index per value, as the file's 16 bytes
    (value l in the low nibble of byte l, value 16 + l in the high one)."""
    t = np.divide(sub, step[..., None], out=np.zeros_like(sub), where=step[..., None] != 0)
    idx = np.abs(t[..., None] - IQ4_LEVELS).argmin(-1).astype(np.uint8)
    return idx[..., :16] | (idx[..., 16:] << 4)


def _iq4_nl(w: np.ndarray) -> np.ndarray:
    """Blocks [B, 32] -> IQ4_NL's [B, 18]: d, then the nibbles; d negative in every other block (both signs)."""
    d = _f16(np.abs(w).max(-1) / 127 * np.where(np.arange(w.shape[0]) % 2, -1.0, 1.0)).astype(np.float32)
    return np.concatenate([_f16(d).view(np.uint8).reshape(-1, 2), _iq4_nibbles(w, d)], 1)


def _iq4_xs(w: np.ndarray) -> np.ndarray:
    """Super-blocks [S, 256] -> IQ4_XS's [S, 136]; the sub-blocks' scales of both signs, -32 among them."""
    sub = w.reshape(-1, 8, 32)
    scale = np.abs(sub).max(-1) / 113 * np.where(np.arange(8) % 2, -1.0, 1.0)
    d = _f16(np.abs(scale).max(-1) / 32).astype(np.float32)
    ls = np.clip(np.round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), -32, 31)
    ls = (ls + 32).astype(np.uint16)
    high = (((ls >> 4) & 3) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype(np.uint16)
    low = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    qs = _iq4_nibbles(sub, d[:, None] * (ls.astype(np.float32) - 32)).reshape(-1, 128)
    return np.concatenate([_f16(d).view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2), low, qs], 1)


def quantize_k(w: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) -> uint8 [N, K / 256 * block bytes], as a GGUF file stores it."""
    n, k = w.shape
    if k % QK_K:
        raise ValueError(f"K-quant rows are whole super-blocks of 256, not {k}")
    blocks = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK_K)
    if qtype == Q.Q6_K:
        out = _q6(blocks)
    elif qtype == Q.IQ4_XS:
        out = _iq4_xs(blocks)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin, sc, m, q = _q45(blocks, 4 if qtype == Q.Q4_K else 5)
        parts = [_f16(d).view(np.uint8).reshape(-1, 2), _f16(dmin).view(np.uint8).reshape(-1, 2), _scales12(sc, m)]
        if qtype == Q.Q5_K:
            qh = np.zeros((q.shape[0], 32), np.uint8)
            for j in range(8):
                qh |= ((q[:, 32 * j:32 * j + 32] >> 4) & 1) << j
            parts.append(qh)
        out = np.concatenate(parts + [_nibbles(q)], 1)
    else:
        raise ValueError(f"not a K-quant: {qtype!r}")
    return out.reshape(n, -1)


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf.quants.quantize for the types it writes, quantize_k for the K-quants and IQ4_XS, _iq4_nl for IQ4_NL."""
    import gguf

    if qtype == Q.IQ4_NL:
        if w.shape[-1] % 32:
            raise ValueError(f"IQ4_NL rows are whole blocks of 32, not {w.shape[-1]}")
        return _iq4_nl(np.ascontiguousarray(w, dtype=np.float32).reshape(-1, 32)).reshape(w.shape[0], -1)
    return quantize_k(w, qtype) if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS) else gguf.quants.quantize(w, qtype)
