/* y[M, N] = x[M, K] @ W[N, K]^T for `--quantization int8` (W8A8, dynamic) on AMX's int8 tiles, for many rows.
 *
 * The operands are int8_gemm.c's: W is quantize.py's Int8Weight as it is (int8 [N, K] row-major, a float32
 * scale per output row), x comes quantized per token (int8 [M, K], a float32 scale per row). int8_gemm.c reads
 * each weight byte once for a few rows on VNNI; from a few dozen rows on the arithmetic dominates, and one
 * tdpbssd multiplies 16 x 16 x 64 signed bytes into exact int32 sums. Each output's int32 dot product is then
 * the one torch._int_mm gives, converted to float32, multiplied by x's row scale, then by W's, then the bias
 * added, in quant_linear_cpu.int8_linear's order, and rounded to x's dtype as torch rounds (bf16.h): the three
 * paths agree bit for bit at every row count, so a row's result never depends on the path its batch took.
 *
 * The weight stays row-major: each thread transposes two 16-row groups of W at a time into its own buffer in the
 * B tiles' layout (row p of a block's tile holds, for each of the 16 rows n, the 4 bytes W[n, 64b + 4p ..
 * 64b + 4p + 3]: a 16 x 16 transpose of 4-byte units), then multiplies every pair of 16-row tiles of x by them
 * (2 x 2 C tiles), K in chunks of CHUNK blocks so that a pair's chunk (32 KB) stays in L1 while every tile pair
 * of x passes by it (their int32 sums kept between chunks); the next two groups are transposed while the tiles
 * multiply, a share beside each tile pair of x, and each 32 x 32 block of sums goes to y while the next block
 * multiplies (quant_amx.c's structure). x taller than X_BYTES goes in parts, each pair of groups transposed
 * again per part.
 * x of at most three tiles (a decode step's batch) takes all of them against one group of W at a time instead,
 * the weight transposed a block at a time into L1 (few_rows).
 *
 * K not a multiple of 64 is zero-padded in the tiles: W's last block is read with masked loads, and x is copied
 * into a buffer whose rows are padded with zeros to a multiple of 64 bytes. (Otherwise x is read where it lies,
 * the rows past the last whole 32 copied into a zeroed tail.) Zeros add nothing to an int32 sum.
 *
 * Without the kernel's permission for the tiles (amx.h), or in a build for a CPU without AMX-INT8,
 * matinee_int8_amx returns -4 and the caller keeps int8_gemm.c or torch._int_mm; -1 where it has no memory.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"

/* amx.h's permission and tile layout (16 rows of 64 bytes in all eight tiles) serve int8 tiles as they are;
 * every CPU with AMX-INT8 has AMX-BF16 too. */
#if defined(AMX_BF16) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AMX_INT8 1
#endif

#ifdef AMX_INT8
#define X_BYTES (1L << 20)   /* x's rows a call multiplies at once: half an L2 */
#define BLOCK 1024           /* one tile: 16 rows of 64 bytes */
#ifndef CHUNK
#define CHUNK 16             /* blocks of K a pair's tiles are read again for: 32 KB, within L1 */
#endif
/* A product kept apart from what it meets next: no fused multiply-add, torch's separate roundings. */
#define KEEP(v) __asm__("" : "+v"(v))

/* r[n] (16 lanes of 4 bytes each) -> r[p] lane n = the old r[n] lane p. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {   /* within 128-bit lanes: rows i, i + 1 interleaved */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 4; g++) {   /* u[4g + j], 128-bit lane L: rows 4g..4g + 3 of column 4L + j */
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; j++) {   /* column 4L + j: lane L of u[j], u[4 + j], u[8 + j], u[12 + j] */
        const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
        r[j] = _mm512_shuffle_i32x4(a, c, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(a, c, 0xdd);
        r[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
}

/* Columns k..k + 63 of `rows` rows of W (rows K bytes apart; zeros for the rest of the 16 and past K) -> their
 * B tile at `tile`. Inlined where it is called (and so are transpose and multiply): called from few_rows too, gcc
 * kept it out of line, and the many-row path's transposes took a quarter of a 1,024-row call (27 -> 33 ms). */
static inline __attribute__((always_inline)) void transpose_block(const int8_t *w, long K, int rows, long k,
                                                                   int8_t *tile) {
    const __mmask64 m = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
    __m512i r[16];
    for (int n = 0; n < 16; n++) r[n] = n < rows ? _mm512_maskz_loadu_epi8(m, w + n * K + k) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(tile + p * 64), r[p]);
}

/* A pair of groups of W (16 rows each) to transpose, block by block, into t0 and t1 (rows1 0 past N). */
typedef struct {
    const int8_t *w;
    long K;
    int rows0, rows1;
    int8_t *t0, *t1;
} Pair;

static inline __attribute__((always_inline)) void transpose(const Pair *p, long b) {
    transpose_block(p->w, p->K, p->rows0, 64 * b, p->t0 + b * BLOCK);
    transpose_block(p->w + 16 * p->K, p->K, p->rows1, 64 * b, p->t1 + b * BLOCK);
}

/* Round to the nearest even bf16 as bf16.h's f32_to_bf16 does (any NaN to 0x7fc0): torch's cast. */
static inline __m256i to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

/* A 32 x 32 block of int32 sums (row stride 32) on its way to y: rows x cols of it, with x's row scales from xs,
 * W's from ws, the bias (or none) from bias, into y (row stride N; bf16 or float32). */
typedef struct {
    const int32_t *out;
    int rows, cols, y_bf16;
    const float *xs, *ws, *bias;
    char *y;
    long N;
} Emission;

static void emit(const Emission *e, int from, int to) {
    for (int r = from; r < to && r < e->rows; r++) {
        const __m512 s = _mm512_set1_ps(e->xs[r]);
        for (int h = 0; h < 32 && h < e->cols; h += 16) {
            const __mmask16 m = e->cols - h >= 16 ? 0xffff : (__mmask16)((1u << (e->cols - h)) - 1);
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(e->out + r * 32 + h))), s);
            KEEP(v);
            v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, e->ws + h));
            KEEP(v);
            if (e->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, e->bias + h));
            if (e->y_bf16)
                _mm256_mask_storeu_epi16(e->y + (r * e->N + h) * 2, m, to_bf16(v));
            else
                _mm512_mask_storeu_ps(e->y + (r * e->N + h) * 4, m, v);
        }
    }
}

/* One or two 16-row tiles of x: block b of the first at a + 64b, its rows `stride` bytes apart, the second's
 * 16 rows further on. */
typedef struct {
    const int8_t *a;
    long stride;
    int two;
} XTiles;

/* What the vector units do while a call's tiles multiply: blocks [from, to) of the next pair to transpose (none
 * where `pair` is NULL), and the block finished before this one to emit (none where `done` is NULL). */
typedef struct {
    const Pair *pair;
    long from, to;
    const Emission *done;
} Aside;

/* Blocks [from, to) of x's tiles times a transposed pair of groups (B tiles at w0 and w1, 1 KB a block)
 * -> the 2 x 2 C tiles, C tile 2i + j x tile i times group j, in `out` (32 x 32 int32): starting from zero, or
 * with `sums`, from the sums there. After each block's products are issued, the vector units take their share
 * of `aside` while the tile unit multiplies. */
static inline __attribute__((always_inline)) void multiply(const XTiles *x, const int8_t *w0, const int8_t *w1,
                                                           long from, long to, const int32_t *sums, int32_t *out,
                                                           const Aside *aside) {
    const long n = to - from, moving = aside->to - aside->from;
    const int share = (int)((32 + n - 1) / n);   /* rows of `done` emitted a block */
    const int8_t *a1 = x->a + 16 * x->stride;
    if (sums) {
        _tile_loadd(0, sums, 128);
        _tile_loadd(1, sums + 16, 128);
        if (x->two) {
            _tile_loadd(2, sums + 512, 128);
            _tile_loadd(3, sums + 512 + 16, 128);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (long b = from; b < to; b++) {
        /* x's tiles pass once a chunk, the pair's chunk is read again for every tile pair of x: x's loads are
         * hinted so */
        _tile_stream_loadd(4, x->a + b * 64, x->stride);
        _tile_loadd(6, w0 + b * BLOCK, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_loadd(7, w1 + b * BLOCK, 64);
        _tile_dpbssd(1, 4, 7);
        if (x->two) {
            _tile_stream_loadd(5, a1 + b * 64, x->stride);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
        }
        if (aside->pair)
            for (long t = aside->from + (b - from) * moving / n; t < aside->from + (b - from + 1) * moving / n; t++)
                transpose(aside->pair, t);
        if (aside->done) emit(aside->done, (int)(b - from) * share, (int)(b - from + 1) * share);
    }
    _tile_stored(0, out, 128);
    _tile_stored(1, out + 16, 128);
    if (x->two) {
        _tile_stored(2, out + 512, 128);
        _tile_stored(3, out + 512 + 16, 128);
    }
}

/* What every thread of a call reads. x's tile rows: rows below `whole` at base + row * stride, the rest in
 * `tail` (zeros after them); stride is K padded to 64 bytes. */
typedef struct {
    const int8_t *base, *tail, *w;
    const float *xs, *ws, *bias;
    char *y;
    int y_bf16;
    long M, N, K, stride, nb, whole, rows;   /* rows: of x in each part but the last (a multiple of 32) */
} Call;

/* One thread's pairs of groups [first, last) and its buffers: `wbuf` holds two pairs' B tiles, pair p + 1
 * transposed into one while p multiplies in the other. */
typedef struct {
    long first, last;
    int flip;
    int8_t *wbuf;
    int32_t *out;     /* one block multiplied, one emitted */
    int32_t *sums;    /* between chunks of K: the part's 32-row tiles' sums, 4 KB each */
    Emission done;    /* the block multiplied last, emitted while the next one multiplies */
} Share;

static int8_t *slot(const Share *s, long nb, long p) { return s->wbuf + (p - s->first) % 2 * 2 * nb * BLOCK; }

/* The rows of W's 16-row group g (0 past N). */
static int group_rows(const Call *c, long g) {
    const long left = c->N - 16 * g;
    return left <= 0 ? 0 : left < 16 ? (int)left : 16;
}

static Pair pair_at(const Call *c, long p, int8_t *tiles) {
    return (Pair){c->w + 32 * p * c->K, c->K, group_rows(c, 2 * p), group_rows(c, 2 * p + 1), tiles,
                  tiles + c->nb * BLOCK};
}

/* Rows [r, r + m) of x by the thread's pairs, into y; K in chunks of CHUNK blocks, each pair's chunk multiplied
 * by all of the part's tiles of x, their sums kept in `sums` between chunks. Out of line: inlined into the parallel
 * region (as gcc did once few_rows was added) the same loops ran ~10% slower at 512 rows. */
__attribute__((noinline)) static void multiply_part(const Call *c, Share *s, long r, long m) {
    const long nb = c->nb, tiles = (m + 15) / 16;
    Pair now = pair_at(c, s->first, slot(s, nb, s->first)), next = now;
    for (long b = 0; b < nb; b++) transpose(&now, b);
    for (long p = s->first; p < s->last; p++) {
        const int8_t *w0 = slot(s, nb, p), *w1 = w0 + nb * BLOCK;
        const int more = p + 1 < s->last;
        if (more) next = pair_at(c, p + 1, slot(s, nb, p + 1));
        const int cols = c->N - 32 * p < 32 ? (int)(c->N - 32 * p) : 32;
        for (long k = 0; k < nb; k += CHUNK) {
            const long end = k + CHUNK < nb ? k + CHUNK : nb;
            for (long t = 0; t < tiles; t += 2) {
                const long row = r + 16 * t;
                const XTiles a = {row + 32 <= c->whole ? c->base + row * c->stride : c->tail, c->stride,
                                  m - 16 * t > 16};
                int32_t *out = end < nb ? s->sums + t / 2 * 1024 : s->out + s->flip * 1024;
                /* the next pair's blocks of this chunk, a share to each tile pair of x: the weight comes from
                 * memory, read beside all of them rather than the first alone */
                const long pairs_of_x = (tiles + 1) / 2, i = t / 2;
                const Aside aside = {more ? &next : NULL, k + (end - k) * i / pairs_of_x, k + (end - k) * (i + 1) / pairs_of_x,
                                     s->done.rows ? &s->done : NULL};
                multiply(&a, w0, w1, k, end, k ? s->sums + t / 2 * 1024 : NULL, out, &aside);
                s->done.rows = 0;
                if (end == nb) {
                    s->done = (Emission){out, m - 16 * t < 32 ? (int)(m - 16 * t) : 32, cols, c->y_bf16, c->xs + row,
                                         c->ws + 32 * p, c->bias ? c->bias + 32 * p : NULL,
                                         c->y + (row * c->N + 32 * p) * (c->y_bf16 ? 2 : 4), c->N};
                    s->flip ^= 1;
                }
            }
        }
    }
}

/* Few rows (a decode step's batch): all of x's tiles (mt of 16 rows, at most FEW_TILES) against one 16-row group
 * of W at a time, so W is read and transposed exactly once, a block at a time into a ring of two in L1 (block b + 1
 * transposed while block b's products run), its rows fetched FETCH_AHEAD blocks ahead. A group's 16 rows are 16
 * streams through memory, which the hardware prefetchers do not run ahead of; a pair's 32 streamed no faster
 * without the fetches. The many-row path above transposes a whole pair ahead and reads it again for each pair of
 * x's tiles: 16384 x 2048 from memory at 16 / 48 rows 1.87 / 1.98 ms, this 1.68 / 1.83 (2048 x 8192 at 48:
 * 0.96 -> 0.76). Accumulator 2i + g holds x tile i by group g of the pair. */
#define FEW_TILES 3
#define FETCH_AHEAD 4

/* Block b's products of x's mt tiles (at a, rows `stride` bytes apart) by one group's B tile t, into accumulators
 * C0, C1, C2. */
#define GROUP_PRODUCTS(C0, C1, C2)                              \
    do {                                                        \
        _tile_loadd(7, t, 64);                                  \
        _tile_loadd(6, a, stride);                              \
        _tile_dpbssd(C0, 6, 7);                                 \
        if (mt > 1) {                                           \
            _tile_loadd(6, a + 16 * stride, stride);            \
            _tile_dpbssd(C1, 6, 7);                             \
        }                                                       \
        if (mt > 2) {                                           \
            _tile_loadd(6, a + 32 * stride, stride);            \
            _tile_dpbssd(C2, 6, 7);                             \
        }                                                       \
    } while (0)

/* Pair p of groups by x's mt tiles (x: 16 mt rows, `stride` bytes apart) -> out [16 mt][32] int32. */
static inline __attribute__((always_inline)) void few_pair(int mt, const Call *c, const int8_t *x, long p,
                                                           int8_t *ring, int32_t *out) {
    const long stride = c->stride, K = c->K;
    for (int g = 0; g < 2; g++) {   /* a group past N (rows 0) leaves its accumulators zero */
        const int rows = group_rows(c, 2 * p + g);
        const int8_t *w = c->w + 16 * (2 * p + g) * K;
        if (g == 0) {
            _tile_zero(0);
            _tile_zero(2);
            _tile_zero(4);
        } else {
            _tile_zero(1);
            _tile_zero(3);
            _tile_zero(5);
        }
        if (!rows) continue;
        transpose_block(w, K, rows, 0, ring);
        for (long b = 0; b < c->nb; b++) {
            const int8_t *t = ring + (b & 1) * BLOCK, *a = x + b * 64;
            if (g == 0)
                GROUP_PRODUCTS(0, 2, 4);
            else
                GROUP_PRODUCTS(1, 3, 5);
            if (b + FETCH_AHEAD < c->nb)
                for (int n = 0; n < rows; n++)
                    _mm_prefetch((const char *)w + n * K + 64 * (b + FETCH_AHEAD), _MM_HINT_T0);
            if (b + 1 < c->nb) transpose_block(w, K, rows, 64 * (b + 1), ring + ((b + 1) & 1) * BLOCK);
        }
    }
    store_accumulators(mt, out);
}

/* x of at most FEW_TILES tiles, its rows (whole tiles of them, zero rows after the last) at x, `stride` apart. */
static int few_rows(const Call *c, const int8_t *x, int threads) {
    const long mt = (c->M + 15) / 16, pairs = (c->N + 31) / 32;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const long first = pairs * omp_get_thread_num() / omp_get_num_threads();
        const long last = pairs * (omp_get_thread_num() + 1) / omp_get_num_threads();
        int8_t *ring = aligned_alloc(64, 2 * BLOCK);
        int32_t *out = aligned_alloc(64, (size_t)FEW_TILES * 16 * 32 * sizeof(int32_t));
        if (!ring || !out) {
#pragma omp atomic write
            failed = 1;
        } else if (first < last) {
            configure_tiles();
            for (long p = first; p < last; p++) {
                if (mt == 1) few_pair(1, c, x, p, ring, out);
                else if (mt == 2) few_pair(2, c, x, p, ring, out);
                else few_pair(3, c, x, p, ring, out);
                const int cols = c->N - 32 * p < 32 ? (int)(c->N - 32 * p) : 32;
                const Emission e = {out, (int)c->M, cols, c->y_bf16, c->xs, c->ws + 32 * p,
                                    c->bias ? c->bias + 32 * p : NULL, c->y + 32 * p * (c->y_bf16 ? 2 : 4), c->N};
                emit(&e, 0, (int)c->M);
            }
            _tile_release();
        }
        free(ring);
        free(out);
    }
    return failed ? -1 : 0;
}

/* x's M rows of K bytes copied `stride` bytes apart into `rows` rows, zeros after each row and after the last;
 * NULL without memory. */
static int8_t *padded_copy(const int8_t *xq, long M, long K, long stride, long rows) {
    int8_t *copy = aligned_alloc(64, (size_t)rows * stride);
    if (!copy) return NULL;
    memset(copy, 0, (size_t)rows * stride);
    for (long i = 0; i < M; i++) memcpy(copy + i * stride, xq + i * K, (size_t)K);
    return copy;
}

/* xq int8 [M, K], xs float32 [M]; w int8 [N, K], ws float32 [N]; bias float32 [N] or NULL; y [M, N] bf16 (y_bf16)
 * or float32. Returns 0, -1 without memory, -2 for K < 1, -4 without AMX-INT8. */
int matinee_int8_amx(const int8_t *xq, const float *xs, const int8_t *w, const float *ws, const float *bias, void *y,
                     int y_bf16, long M, long N, long K, int threads) {
    if (!amx_permitted()) return -4;
    if (K < 1) return -2;
    if (M <= 0 || N <= 0) return 0;
    const long stride = (K + 63) / 64 * 64, most = X_BYTES / stride / 32 * 32 > 32 ? X_BYTES / stride / 32 * 32 : 32;
    const long parts = (M + most - 1) / most, pairs = (N + 31) / 32;
    Call c = {xq, NULL, w, xs, ws, bias, y, y_bf16, M, N, K, stride, stride / 64, M / 32 * 32,
              ((M + parts - 1) / parts + 31) / 32 * 32};
    int8_t *copy = NULL;
    if (M <= FEW_TILES * 16) {   /* in place where the rows are whole tiles of the stride, else from a padded copy */
        if ((K % 64 || M % 16) && !(copy = padded_copy(xq, M, K, stride, (M + 15) / 16 * 16))) return -1;
        const int status = few_rows(&c, copy ? copy : xq, threads);
        free(copy);
        return status;
    }
    if (K % 64) {   /* every row padded with zeros to the stride, and the rows to a multiple of 32 */
        c.whole = (M + 31) / 32 * 32;
        if (!(copy = padded_copy(xq, M, K, stride, c.whole))) return -1;
        c.base = copy;
    } else if (M > c.whole) {   /* rows past the last whole 32, with zeros after them: no tile reads past x */
        if (!(copy = aligned_alloc(64, (size_t)32 * K))) return -1;
        memcpy(copy, xq + c.whole * K, (size_t)(M - c.whole) * K);
        memset(copy + (M - c.whole) * K, 0, (size_t)(32 - (M - c.whole)) * K);
        c.tail = copy;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const long first = pairs * omp_get_thread_num() / omp_get_num_threads();
        const long last = pairs * (omp_get_thread_num() + 1) / omp_get_num_threads();
        Share s = {first, last, 0, aligned_alloc(64, (size_t)4 * c.nb * BLOCK),
                   aligned_alloc(64, 2 * 32 * 32 * sizeof(int32_t)), NULL, {0}};
        if (c.nb > CHUNK) s.sums = aligned_alloc(64, (size_t)(c.rows + 31) / 32 * 4096);
        if (!s.wbuf || !s.out || (c.nb > CHUNK && !s.sums)) {
#pragma omp atomic write
            failed = 1;
        } else if (first < last) {
            configure_tiles();
            for (long r = 0; r < M; r += c.rows) multiply_part(&c, &s, r, M - r < c.rows ? M - r : c.rows);
            emit(&s.done, 0, s.done.rows);
            _tile_release();
        }
        free(s.wbuf);
        free(s.out);
        free(s.sums);
    }
    free(copy);
    return failed ? -1 : 0;
}
#else
int matinee_int8_amx(const int8_t *xq, const float *xs, const int8_t *w, const float *ws, const float *bias, void *y,
                     int y_bf16, long M, long N, long K, int threads) {
    (void)xq, (void)xs, (void)w, (void)ws, (void)bias, (void)y, (void)y_bf16, (void)M, (void)N, (void)K;
    (void)threads;
    return -4;   /* built for a CPU without AMX-INT8 */
}
#endif
