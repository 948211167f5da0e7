/* x[M, K] (bf16 or float32) -> int8 rows and a float32 scale per row, for `--quantization int8` on the CPU:
 * quantize.quantize_activations bit for bit (scale = max |x| of the row, at least 1e-12, / 127; q = x / scale
 * rounded half to even, clamped to +-127), in one pass for the maximum and one for the quotients where torch
 * makes six over float32 copies of x: at 256 rows of 2048 they took longer than int8_amx.c's product.
 * (A row holding NaN or inf is left to torch's own results: not matched here.) Without AVX-512,
 * matinee_quantize_rows returns -2 and quantize_activations serves.
 */
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m512 load16(const void *x, int bf16, long at, __mmask16 m) {
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x + at)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)x + at);
}

static void quantize_row(const void *x, int bf16, long row, long K, int8_t *q, float *scale) {
    const long at = row * K;
    __m512 top = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
        top = _mm512_max_ps(top, _mm512_abs_ps(load16(x, bf16, at + k, m)));
    }
    float amax = _mm512_reduce_max_ps(top);
    const float s = (amax > 1e-12f ? amax : 1e-12f) / 127.0f;
    scale[row] = s;
    const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (long k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(x, bf16, at + k, m), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        _mm_mask_storeu_epi8(q + at + k, m, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
    }
}

/* x [M, K] bf16 (x_bf16) or float32 -> q int8 [M, K], scale float32 [M]. Returns 0, or -2 without AVX-512. */
int matinee_quantize_rows(const void *x, int x_bf16, int8_t *q, float *scale, long M, long K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M * K >= (1L << 16))
    for (long row = 0; row < M; row++) quantize_row(x, x_bf16, row, K, q, scale);
    return 0;
}
#else
int matinee_quantize_rows(const void *x, int x_bf16, int8_t *q, float *scale, long M, long K, int threads) {
    (void)x, (void)x_bf16, (void)q, (void)scale, (void)M, (void)K, (void)threads;
    return -2;
}
#endif
