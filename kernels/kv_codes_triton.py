"""int8 and fp8 e4m3 KV codes <-> float32 inside Triton kernels (kv_quant.py's quantize and the cast back).

fp8 codes travel as uint8 and are made with integer and float32 ops of exact results, so every
device, and Triton's interpreter (whose own fp8 casts round differently), gives torch's
float8_e4m3fn bits. Rounding to nearest even adds and subtracts 1.5 * 2^23, exact for |x| < 2^22.
"""

import triton
import triton.language as tl

ROUNDER = tl.constexpr(12582912.0)   # 1.5 * 2^23; a constexpr, as compiled kernels read globals


@triton.jit
def _round_even(x):
    return (x + ROUNDER) - ROUNDER


@triton.jit
def code_values(codes, FP8: tl.constexpr):
    """Codes -> the float32 values they stand for before their scale (e4m3.h's e4m3_to_f32)."""
    if FP8:
        c = codes.to(tl.uint32)
        bits = ((c & 0x7F) << 20) | ((c & 0x80) << 24)
        return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36   # 2^120
    return codes.to(tl.float32)


@triton.jit
def quantize_values(x, QMAX: tl.constexpr, FP8: tl.constexpr):
    """float32 values already divided by their scale -> codes, to nearest even, clamped to +-QMAX."""
    x = tl.minimum(tl.maximum(x, -QMAX), QMAX)
    if FP8:
        bits = x.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        exponent = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32) - 127, -6)
        step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
        r = _round_even(tl.math.div_rn(tl.abs(x), step)) * step   # not `/`: see kv_write_triton.py
        normal = (r.to(tl.uint32, bitcast=True) >> 20) - (120 << 3)
        subnormal = (r * 512.0).to(tl.uint32)
        codes = (tl.where(r < 0.015625, subnormal, normal) | sign).to(tl.uint8)
    else:
        codes = _round_even(x).to(tl.int8)
    return codes   # one return: the compiler checks every return's type, even where FP8 rules one out
