/* e^x eight (exp8, AVX2) or sixteen (exp16, AVX-512) lanes at a time for the CPU kernels: Cephes' expf
 * polynomial, within 2 ulp of expf, where glibc's expf is a call per element. x is taken up to 88.3 (the
 * caller clamps anything larger; the attention's scores minus their max are <= 0) and from -87.3, where
 * e^x is a normal float; a NaN comes out as NaN (max_ps returns its second operand, x, for a NaN). */
#ifndef MATINEE_VEXP_H
#define MATINEE_VEXP_H
#include <immintrin.h>

#define DEFINE_EXP(name, T, P, SI, ROUND)                                                                       \
    static inline T name(T x) {                                                                               \
        x = P##_max_ps(P##_set1_ps(-87.3f), x);                                                                \
        T n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)));                                         \
        x = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                                    \
        x = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), x);                                                 \
        T y = P##_set1_ps(1.9875691500e-4f);                                                                   \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.3981999507e-3f));                                                 \
        y = P##_fmadd_ps(y, x, P##_set1_ps(8.3334519073e-3f));                                                 \
        y = P##_fmadd_ps(y, x, P##_set1_ps(4.1665795894e-2f));                                                 \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.6666665459e-1f));                                                 \
        y = P##_fmadd_ps(y, x, P##_set1_ps(5.0000001201e-1f));                                                 \
        y = P##_fmadd_ps(y, P##_mul_ps(x, x), P##_add_ps(x, P##_set1_ps(1.f)));                                \
        __m##SI##i e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);             \
        return P##_mul_ps(y, P##_castsi##SI##_ps(e));                                                          \
    }
#ifdef __AVX2__
#define ROUND8(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
DEFINE_EXP(exp8, __m256, _mm256, 256, ROUND8)
#endif
#ifdef __AVX512F__
#define ROUND16(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
DEFINE_EXP(exp16, __m512, _mm512, 512, ROUND16)
#endif
#endif
