/* bfloat16 <-> float32 for the CPU kernels, scalar, bit for bit as torch converts. */
#ifndef MATINEE_BF16_H
#define MATINEE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 cast does: any NaN becomes 0x7fc0. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* 8 or 16 bf16 (16-bit lanes of h) -> float32, exactly: each one's bits moved to the high half. */
#ifdef __AVX2__
#include <immintrin.h>
static inline __m256 bf16x8_to_f32(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
#endif
#ifdef __AVX512F__
static inline __m512 bf16x16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif
#endif
