/* y[M, N] = x[M, K] @ W[N, K]^T with W in bfloat16, packed once at load (packed_linear.py).
 *
 * The packed weight is [ceil(N/32), K, 32]: for each block of 32 output columns, the K rows of
 * 32 values one after another, so a block is one contiguous stream of 64-byte lines. Within a
 * line, position 2i holds column i and position 2i+1 column 16+i: a 32-bit lane's low half
 * shifted left 16 is column i in float32, its high half masked is column 16+i, two cheap integer
 * ops instead of two shuffles (whose port the FMAs share). bf16 dot products (vdpbf16ps) issue
 * at half the f32 FMA rate on the reference Xeon, so the weights are widened in registers and
 * multiplied in float32; where they issue at the FMA's rate (Zen 4) they do twice its work, and the
 * `dot` path below takes bf16 rows through them (packed_linear.py measures which is faster per shape).
 * Every output is summed over k = 0..K-1 in order, in one register, so a
 * row's result never depends on the other rows of the batch or on the thread count. The same
 * layout serves the AVX2 path (4 ymm per line) and the AVX-512 one (2 zmm).
 *
 * A float16 weight (`w_half`: a float16 checkpoint under float32 activations) is packed the same way but with
 * each line's 32 values in column order, widened by F16C's conversion, 8 (AVX2) or 16 (AVX-512) at a time.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define NR 32
/* Lines of w (one per k) prefetched ahead, 8 KB: the hardware prefetcher alone left SmolLM2's
 * matmuls 1.8x slower at 8 rows (28 ms against 15) and 1.05x at one; 24 lines measured 13 ms
 * and 16 at those sizes, 96 to 192 lines 12-13 and 14-15. */
#define PREFETCH 128

#ifdef __AVX512F__
#define MR_MAX 8                    /* 16 accumulators + 8 broadcasts + 1 weight vector of 32 zmm */
#define NV 2
#define WIDTH 512
typedef __m512 vf;
static const int COLUMN[NV] = {0, 16};

/* Vector j of a line: j = 0 the low halves of its 32 values shifted up (columns 0-15), 1 the high halves masked. */
static inline __attribute__((always_inline)) vf widen(const uint16_t *p, int j) {
    __m512i raw = _mm512_loadu_si512(p);
    return _mm512_castsi512_ps(j ? _mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000))
                                 : _mm512_slli_epi32(raw, 16));
}
/* Vector j of a float16 line: its columns 16j..16j+15 converted. */
static inline __attribute__((always_inline)) vf widen_half(const uint16_t *p, int j) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 16 * j)));
}
static const int HALF_COLUMN[NV] = {0, 16};
#define VZERO _mm512_setzero_ps
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VSTORE _mm512_storeu_ps
#else
#define MR_MAX 3                    /* 12 accumulators + 3 broadcasts + 1 weight vector: all 16 ymm */
#define NV 4
#define WIDTH 256
typedef __m256 vf;
static const int COLUMN[NV] = {0, 16, 8, 24};

/* Vector j of a line (columns COLUMN[j]..+7): j even the low halves of 16 values shifted up, j odd their high
 * halves masked, each read from the line itself: 12 accumulators, 3 broadcasts and this one vector fill the 16
 * ymm registers, where the four widened vectors held at once spilled an accumulator to the stack. */
static inline __attribute__((always_inline)) vf widen(const uint16_t *p, int j) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 16 * (j / 2)));
    return _mm256_castsi256_ps(j % 2 ? _mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000))
                                     : _mm256_slli_epi32(raw, 16));
}
/* Vector j of a float16 line: its columns 8j..8j+7 converted. */
static inline __attribute__((always_inline)) vf widen_half(const uint16_t *p, int j) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * j)));
}
static const int HALF_COLUMN[NV] = {0, 8, 16, 24};
#define VZERO _mm256_setzero_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VSTORE _mm256_storeu_ps
#endif

/* MR rows of x (float32, stride K) times one packed block of w into tile[MR][NR], columns in order: NAME_MR
 * reads its lines' vector j by WIDEN(line, j), columns COLUMNS[j]... */
#define KERNEL(NAME, WIDEN, COLUMNS, MR)                                                           \
    static void NAME##_##MR(const void *xv, long K, const uint16_t *w, float *tile) {              \
        const float *x = (const float *)xv;                                                        \
        vf acc[MR][NV];                                                                            \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NV; j++) acc[i][j] = VZERO();                                      \
        for (long k = 0; k < K; k++) {                                                             \
            vf xv[MR];                                                                             \
            _mm_prefetch((const char *)(w + (k + PREFETCH) * NR), _MM_HINT_T0);                    \
            for (int i = 0; i < MR; i++) xv[i] = VSET1(x[i * K + k]);                              \
            for (int j = 0; j < NV; j++) {                                                         \
                vf wj = WIDEN(w + k * NR, j);                                                      \
                for (int i = 0; i < MR; i++) acc[i][j] = VFMA(xv[i], wj, acc[i][j]);               \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NV; j++) VSTORE(tile + i * NR + COLUMNS[j], acc[i][j]);            \
    }

/* MR rows of x (stride K; float32 here, bf16 for the dot kernels) times one packed block into a tile. */
typedef void (*kernel_fn)(const void *, long, const uint16_t *, float *);

#define KERNELS_OF(NAME, WIDEN, COLUMNS) \
    KERNEL(NAME, WIDEN, COLUMNS, 1) KERNEL(NAME, WIDEN, COLUMNS, 2) KERNEL(NAME, WIDEN, COLUMNS, 3)
KERNELS_OF(kernel, widen, COLUMN)
KERNELS_OF(half, widen_half, HALF_COLUMN)
#if MR_MAX == 8
#define MORE_KERNELS_OF(NAME, WIDEN, COLUMNS) KERNEL(NAME, WIDEN, COLUMNS, 4) KERNEL(NAME, WIDEN, COLUMNS, 5) \
    KERNEL(NAME, WIDEN, COLUMNS, 6) KERNEL(NAME, WIDEN, COLUMNS, 7) KERNEL(NAME, WIDEN, COLUMNS, 8)
MORE_KERNELS_OF(kernel, widen, COLUMN)
MORE_KERNELS_OF(half, widen_half, HALF_COLUMN)
static const kernel_fn KERNELS[MR_MAX + 1] = {0, kernel_1, kernel_2, kernel_3, kernel_4, kernel_5, kernel_6,
                                              kernel_7, kernel_8};
static const kernel_fn HALVES[MR_MAX + 1] = {0, half_1, half_2, half_3, half_4, half_5, half_6, half_7, half_8};
#else
static const kernel_fn KERNELS[MR_MAX + 1] = {0, kernel_1, kernel_2, kernel_3};
static const kernel_fn HALVES[MR_MAX + 1] = {0, half_1, half_2, half_3};
#endif

/* n floats to bf16 with the same rounding as f32_to_bf16, 8 at a time with AVX2 integer ops. */
static void store_bf16(const float *src, uint16_t *dst, int n) {
    int i = 0;
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), nan = _mm256_set1_epi32(0x7fc0);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(src + i);
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(half, lsb)), 16);
        r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan),
                                                 _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        /* packus works within 128-bit lanes: gather the two low quadwords into the low half. */
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_castsi256_si128(packed));
    }
    for (; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

/* rows x cols of a tile (+ bias) into y, as float32 or bf16. */
static void emit(float *tile, int rows, int cols, const float *bias, void *y, int y_bf16, long ldy) {
    for (int r = 0; r < rows; r++) {
        float *t = tile + r * NR;
        if (bias)
            for (int c = 0; c < cols; c++) t[c] += bias[c];
        if (y_bf16)
            store_bf16(t, (uint16_t *)y + r * ldy, cols);
        else
            memcpy((float *)y + r * ldy, t, cols * sizeof(float));
    }
}

int matinee_packed_width(void) { return WIDTH; }

#ifdef __AVX512BF16__
/* The same packed weight multiplied by bf16 rows through vdpbf16ps: two k at a time per instruction,
 * twice the float32 FMA's rate where the CPU runs both at one a cycle (Zen 4). Lines k and k + 1 are
 * interleaved by 16-bit unpacks, so each 32-bit lane holds one column's (w[k], w[k + 1]) pair, met by
 * one broadcast of x's (x[k], x[k + 1]). Products of two bf16 are exact in float32; each instruction
 * adds the pair's odd product, then its even one, to the accumulator, with bf16 and float32 subnormals
 * read and written as zero (the instruction's DAZ and FTZ). Every output is still summed over k in
 * order in one register: a row's result does not depend on the other rows or the thread count. */
#define MR_DOT 12                   /* 24 accumulators + 2 lines + 2 unpacks + 1 broadcast of 32 zmm */

/* unpacklo puts columns 4L, 16+4L, 4L+1, 16+4L+1 in 32-bit lanes 4L..4L+3 of each 128-bit lane L,
 * unpackhi 4L+2, 16+4L+2, 4L+3, 16+4L+3: where each column's sum ends up, as permutex2var indices
 * (16 and up: the second accumulator), columns 0-15 then 16-31. */
static const int32_t DOT_FROM[NR] __attribute__((aligned(64))) = {
    0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30,
    1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31};

static inline int32_t pair_at(const uint16_t *x) {   /* x[0], x[1] as one 32-bit lane: a broadcast from memory */
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}

/* One k pair (lines a, b) into MR rows' two accumulators; x_at(i): row i's pair as a 32-bit lane. */
static inline __attribute__((always_inline)) void dot_pair(const int MR, __m512 acc[][2], __m512i a, __m512i b,
                                                           const uint16_t *x, long K, long k, int odd) {
    __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
    for (int i = 0; i < MR; i++) {
        __m512bh xv = (__m512bh)_mm512_set1_epi32(odd ? (int)x[i * K + k] : pair_at(x + i * K + k));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], lo, xv);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], hi, xv);
    }
}

/* MR rows of x (bf16, stride K) times one packed block of w into tile[MR][NR], columns in order. */
static inline __attribute__((always_inline)) void dot_kernel(const int MR, const uint16_t *x, long K,
                                                             const uint16_t *w, float *tile) {
    __m512 acc[MR_DOT][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 1 < K; k += 2) {
        _mm_prefetch((const char *)(w + (k + PREFETCH) * NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + (k + 1 + PREFETCH) * NR), _MM_HINT_T0);
        dot_pair(MR, acc, _mm512_loadu_si512(w + k * NR), _mm512_loadu_si512(w + (k + 1) * NR), x, K, k, 0);
    }
    if (k < K)   /* an odd K's last line, paired with zeros */
        dot_pair(MR, acc, _mm512_loadu_si512(w + k * NR), _mm512_setzero_si512(), x, K, k, 1);
    const __m512i first = _mm512_load_si512(DOT_FROM), second = _mm512_load_si512(DOT_FROM + 16);
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(tile + i * NR, _mm512_permutex2var_ps(acc[i][0], first, acc[i][1]));
        _mm512_storeu_ps(tile + i * NR + 16, _mm512_permutex2var_ps(acc[i][0], second, acc[i][1]));
    }
}

#define DOT_KERNEL(MR) \
    static void dot_##MR(const void *x, long K, const uint16_t *w, float *tile) { dot_kernel(MR, x, K, w, tile); }

DOT_KERNEL(1) DOT_KERNEL(2) DOT_KERNEL(3) DOT_KERNEL(4) DOT_KERNEL(5) DOT_KERNEL(6)
DOT_KERNEL(7) DOT_KERNEL(8) DOT_KERNEL(9) DOT_KERNEL(10) DOT_KERNEL(11) DOT_KERNEL(12)
static const kernel_fn DOTS[MR_DOT + 1] = {0, dot_1, dot_2, dot_3, dot_4, dot_5, dot_6, dot_7, dot_8, dot_9, dot_10,
                                        dot_11, dot_12};

#define HAS_DOT 1
#else
#define HAS_DOT 0
#define MR_DOT 1
static const kernel_fn DOTS[MR_DOT + 1] = {0};
#endif

/* Rows [m0, m0 + rows) of x (x_size bytes a value) times every block of w, through kernels[1..mr_max]; the
 * blocks are shared among the threads of the caller's parallel region. */
static void pass(const kernel_fn *kernels, int mr_max, const char *x, size_t x_size, long m0, long rows,
                 const uint16_t *w, const float *bias, void *y, int y_bf16, long N, long K) {
    const long blocks = (N + NR - 1) / NR;
    const size_t elem = y_bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp for schedule(static) nowait
    for (long b = 0; b < blocks; b++) {
        float tile[(MR_MAX > MR_DOT ? MR_MAX : MR_DOT) * NR] __attribute__((aligned(64)));
        int cols = N - b * NR < NR ? (int)(N - b * NR) : NR;
        const uint16_t *wb = w + b * K * NR;
        long m = m0, left = rows;
        /* Groups of near-equal size: 9 rows as 5 + 4, not 8 + 1. */
        for (long groups = (rows + mr_max - 1) / mr_max; left > 0; groups--) {
            int mr = (int)((left + groups - 1) / groups);
            kernels[mr](x + m * K * x_size, K, wb, tile);
            emit(tile, mr, cols, bias ? bias + b * NR : 0, (char *)y + (m * N + b * NR) * elem, y_bf16, N);
            m += mr;
            left -= mr;
        }
    }
}

/* Rows per pass over the weights: as many as keep x's rows (x_size bytes a value) within half of L2. */
static long chunk_rows(long K, size_t x_size, int mr_max) {
    long chunk = (1L << 20) / (K * (long)x_size + 1);
    return chunk < mr_max ? mr_max : chunk;
}

/* Whether this build has the vdpbf16ps path (`dot` below). */
int matinee_packed_dot(void) { return HAS_DOT; }

/* y = x @ W^T (+ bias). x is [M, K] bf16 (x_bf16) or float32; w the packed weight, float16 values (w_half) or
 * bf16; bias float32 [N] or NULL; y [M, N] bf16 (y_bf16) or float32; `dot`: bf16 x through vdpbf16ps
 * (matinee_packed_dot). Returns 0, -1 when out of memory, -2 for `dot` with float32 x or a float16 weight, or in
 * a build without it. */
int matinee_packed_gemm(const void *x, int x_bf16, const uint16_t *w, int w_half, const float *bias, void *y,
                        int y_bf16, long M, long N, long K, int threads, int dot) {
    if (dot && (!x_bf16 || w_half || !HAS_DOT)) return -2;
    const void *xs = x;   /* the rows the kernels read: bf16 for dot, else float32 */
    float *scratch = 0;
    if (x_bf16 && !dot) {
        size_t bytes = ((size_t)M * K * sizeof(float) + 63) & ~(size_t)63;
        scratch = aligned_alloc(64, bytes ? bytes : 64);
        if (!scratch) return -1;
        xs = scratch;
    }
    const kernel_fn *kernels = dot ? DOTS : w_half ? HALVES : KERNELS;
    const int mr_max = dot ? MR_DOT : MR_MAX;
    const size_t x_size = dot ? sizeof(uint16_t) : sizeof(float);
    const long chunk = chunk_rows(K, x_size, mr_max);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (scratch) {
#pragma omp for schedule(static)
            for (long i = 0; i < M * K; i++) scratch[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        }
        for (long m0 = 0; m0 < M; m0 += chunk)
            pass(kernels, mr_max, xs, x_size, m0, M - m0 < chunk ? M - m0 : chunk, w, bias, y, y_bf16, N, K);
    }
    free(scratch);
    return 0;
}
