/* y[M, N] = x[M, K] @ W[N, K]^T for `--quantization int8` on the CPU (W8A8, dynamic): W is quantize.py's
 * Int8Weight as it is (int8 [N, K] row-major, one float32 scale per output row), x comes quantized per
 * token by quantize.quantize_activations (int8 [M, K], one float32 scale per row).
 *
 * Each output is one exact int32 dot product of a row of x and a row of W, as torch._int_mm gives it:
 * vpdpbusd multiplies unsigned by signed bytes, so x's bytes go in as x + 128 (an xor with 0x80) and
 * 128 times the row's sum of W (worked out once at load, `wsum`) comes off. The sum is converted to
 * float32, multiplied by x's scale, then by W's, then the bias added, in quant_linear_cpu.int8_linear's
 * order: the two agree bit for bit. A tile is one row of x against NR rows of W, one 64-byte column of
 * each per step, so at one row W streams from memory once, NR rows side by side; 64-byte columns past K
 * are masked loads. Without AVX-512 VNNI, matinee_int8_gemm returns -2 and torch._int_mm serves;
 * quant_linear_cpu.py sends it the row counts where it measured faster than torch._int_mm.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define NR 4
#define ROWS_PER_TASK 64   /* rows of W a thread takes at a time */
/* A product kept apart from the bias it meets: no fused multiply-add, torch's separate rounding. */
#define KEEP(v) __asm__("" : "+x"(v))

/* The sums of four vectors of int32, lane j of the result the sum of v[j]. */
static inline __m128i sum4(__m512i a, __m512i b, __m512i c, __m512i d) {
    __m512i v[4] = {a, b, c, d};
    __m128i h[4];
    for (int j = 0; j < 4; j++) {
        __m256i t = _mm256_add_epi32(_mm512_castsi512_si256(v[j]), _mm512_extracti64x4_epi64(v[j], 1));
        h[j] = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    }
    return _mm_hadd_epi32(_mm_hadd_epi32(h[0], h[1]), _mm_hadd_epi32(h[2], h[3]));
}

/* One row of x against nr rows of W: their int32 dot products into dots[NR] (zeros past nr). One row of x
 * a pass: gcc 12 copied every accumulator of a several-row tile through another register and the stack
 * each step (0.7-0.9x the time at 4-64 rows, measured), and at one row the tile streams W anyway. */
static inline __attribute__((always_inline)) void tile(const int nr, const int8_t *x, const int8_t *w, long K,
                                                       int32_t dots[NR]) {
    __m512i acc[NR];
    for (int j = 0; j < NR; j++) acc[j] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (long k = 0; k < K; k += 64) {
        const __mmask64 m = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        const __m512i xv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, x + k), flip);   /* x + 128, unsigned */
        for (int j = 0; j < nr; j++) {
            _mm_prefetch((const char *)(w + j * K + k + 512), _MM_HINT_T0);
            acc[j] = _mm512_dpbusd_epi32(acc[j], xv, _mm512_maskz_loadu_epi8(m, w + j * K + k));
        }
    }
    _mm_storeu_si128((__m128i *)dots, sum4(acc[0], acc[1], acc[2], acc[3]));
}

typedef void (*tile_fn)(const int8_t *, const int8_t *, long, int32_t[NR]);
#define TILE(B) static void tile_##B(const int8_t *x, const int8_t *w, long K, int32_t d[NR]) { tile(B, x, w, K, d); }
TILE(1) TILE(2) TILE(3) TILE(4)
static const tile_fn TILES[NR + 1] = {0, tile_1, tile_2, tile_3, tile_4};

int matinee_int8_vnni(void) { return 1; }

/* Returns 0; -2 where this build has no AVX-512 VNNI. xq int8 [M, K], xs float32 [M]; w int8 [N, K], wsum
 * int32 [N] (each row's sum), ws float32 [N]; bias float32 [N] or NULL; y [M, N] bf16 (y_bf16) or float32. */
int matinee_int8_gemm(const int8_t *xq, const float *xs, const int8_t *w, const int32_t *wsum, const float *ws,
                      const float *bias, void *y, int y_bf16, long M, long N, long K, int threads) {
    const long tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    long chunk = (512L << 10) / (K + 1);   /* rows of x per pass over W: within L2 */
    if (chunk < 1) chunk = 1;
    for (long m0 = 0; m0 < M; m0 += chunk) {
        const long rows = M - m0 < chunk ? M - m0 : chunk;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (long t = 0; t < tasks; t++) {
            const long n_end = (t + 1) * ROWS_PER_TASK < N ? (t + 1) * ROWS_PER_TASK : N;
            for (long n = t * ROWS_PER_TASK; n < n_end; n += NR) {
                const int nr = n_end - n < NR ? (int)(n_end - n) : NR;
                for (long m = m0; m < m0 + rows; m++) {
                    int32_t dots[NR];
                    TILES[nr](xq + m * K, w + n * K, K, dots);
                    for (int j = 0; j < nr; j++) {
                        float v = (float)(dots[j] - 128 * wsum[n + j]) * xs[m];
                        KEEP(v);
                        v *= ws[n + j];
                        KEEP(v);
                        if (bias) v += bias[n + j];
                        if (y_bf16)
                            ((uint16_t *)y)[m * N + n + j] = f32_to_bf16(v);
                        else
                            ((float *)y)[m * N + n + j] = v;
                    }
                }
            }
        }
    }
    return 0;
}
#else
int matinee_int8_vnni(void) { return 0; }

int matinee_int8_gemm(const int8_t *xq, const float *xs, const int8_t *w, const int32_t *wsum, const float *ws,
                      const float *bias, void *y, int y_bf16, long M, long N, long K, int threads) {
    (void)xq, (void)xs, (void)w, (void)wsum, (void)ws, (void)bias, (void)y, (void)y_bf16, (void)M, (void)N, (void)K;
    (void)threads;
    return -2;
}
#endif
