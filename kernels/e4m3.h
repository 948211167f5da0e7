/* fp8 e4m3 ("fn": no infinities, NaN at 0x7f/0xff) <-> float32 for the CPU kernels, scalar, bit for
 * bit as torch's float8_e4m3fn casts for every value the KV cache writes (|x| <= 448, no NaN). */
#ifndef MATINEE_E4M3_H
#define MATINEE_E4M3_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The code's exponent and mantissa bits placed where float32 has them give the value times 2^-120,
 * subnormals included (they land on float32 subnormals): one shift and one exact multiply. The
 * vector loaders in paged_attention_cpu.c do the same. */
#define E4M3_BIAS_SHIFT 0x1p120f

static inline float e4m3_to_f32(uint8_t c) {
    uint32_t u = ((uint32_t)(c & 0x7f) << 20) | ((uint32_t)(c & 0x80) << 24);
    float f;
    memcpy(&f, &u, 4);
    return f * E4M3_BIAS_SHIFT;
}

/* Round to nearest even; |x| <= 448 (the caller clamps). Below 2^-6 e4m3 is subnormal, in steps of 2^-9.
 * Branch-free, so that a loop of it vectorises: the step and its inverse are powers of two made from
 * the exponent bits, so dividing by the step and multiplying back are exact. */
static inline uint8_t f32_to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t sign = (u >> 24) & 0x80;
    int32_t e = (int32_t)((u >> 23) & 0xff) - 127;
    e = e < -6 ? -6 : e;
    uint32_t step_bits = (uint32_t)(e - 3 + 127) << 23, inverse_bits = (uint32_t)(127 - (e - 3)) << 23;
    float step, inverse;
    memcpy(&step, &step_bits, 4);
    memcpy(&inverse, &inverse_bits, 4);
    float r = rintf(fabsf(x) * inverse) * step;
    uint32_t r_bits;
    memcpy(&r_bits, &r, 4);
    uint32_t code = r < 0x1p-6f ? (uint32_t)(r * 512.f) : (r_bits >> 20) - (120u << 3);
    return (uint8_t)(sign | code);
}
#endif
