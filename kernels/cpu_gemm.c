/* y[M, N] = x[M, K] @ w[N, K]^T in float32 for a few rows of x (AVX2 + FMA).
 *
 * A decode step multiplies a handful of token rows by every weight of the model, so its cost is
 * reading the weights. Each 4-row tile of w is streamed from memory once and kept in L1 while
 * every pair of x rows is multiplied by it. Every output element is summed in the same order
 * whatever M is and whichever tile computes it, so a row's result never depends on the other
 * rows of the batch. Built by cpu_native.py; its reference is torch's x @ w.T.
 */
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* MB rows of x (stride K) times NB rows of w (stride K) into y (row stride N). Eight lanes
 * accumulate along K; the lanes are then added in a fixed order, and the K % 8 tail last.
 * `next` (or NULL) is the next tile of w: it is prefetched meanwhile, because one core's
 * hardware prefetcher alone leaves the memory bus idle between tiles (25% slower at 8 rows). */
#define TILE(MB, NB)                                                                               \
    static inline __attribute__((always_inline)) void tile_##MB##x##NB(                           \
        const float *x, const float *w, long K, float *y, long N, const float *next) {             \
        __m256 acc[MB][NB];                                                                        \
        for (int i = 0; i < MB; i++)                                                               \
            for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();                          \
        long k8 = K & ~7L;                                                                         \
        for (long k = 0; k < k8; k += 8) {                                                         \
            __m256 wv[NB];                                                                         \
            for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);                   \
            if (next != 0 && (k & 15) == 0)  /* one 64-byte line per row every 16 floats */        \
                for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(next + j * K + k), _MM_HINT_T0); \
            for (int i = 0; i < MB; i++) {                                                         \
                __m256 xv = _mm256_loadu_ps(x + i * K + k);                                        \
                for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);    \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MB; i++)                                                               \
            for (int j = 0; j < NB; j++) {                                                         \
                float tail = 0.f;                                                                  \
                for (long k = k8; k < K; k++) tail += x[i * K + k] * w[j * K + k];                 \
                y[i * N + j] = hsum(acc[i][j]) + tail;                                             \
            }                                                                                      \
    }

TILE(1, 1)
TILE(1, 4)
TILE(2, 4)

void matinee_sgemm_nt(const float *x, const float *w, float *y, long M, long N, long K, int threads) {
    long tiles = N / 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long t = 0; t < tiles; t++) {
        const float *wt = w + 4 * t * K;
        const float *next = t + 1 < tiles ? wt + 4 * K : 0;
        long m = 0;
        /* Every pass over a tile prefetches the next: spread over the passes, the prefetches measured
         * faster than all of them in the first pass. */
        for (; m + 2 <= M; m += 2) tile_2x4(x + m * K, wt, K, y + m * N + 4 * t, N, next);
        if (m < M) tile_1x4(x + m * K, wt, K, y + m * N + 4 * t, N, next);
    }
    for (long n = 4 * tiles; n < N; n++)
        for (long m = 0; m < M; m++) tile_1x1(x + m * K, w + n * K, K, y + m * N + n, N, 0);
}
