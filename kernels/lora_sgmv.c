/* Batched LoRA on the CPU (punica's SGMV): out[rows] += x[rows] @ A[slot] @ B[slot] for every segment of
 * a step's rows that reads the adapter in pool slot `slot`, all segments in one call.
 *
 * The pool's stacks (lora_slots.py) hold one projection group's modules side by side: A [slots, K, R] with
 * each module's max_rank columns in turn, B [slots, R, N] block-diagonal, each module's rows writing only
 * its own output columns. `blocks` names the non-zero part of B, (rank_at, out_at, width) a module, and a
 * segment's rank says how many of each module's rank columns its adapter fills: only those are read, so
 * neither the zeros of the block diagonal nor those of a smaller rank cost memory traffic, which is what a
 * decode step's LoRA costs (a handful of rows against every adapter's weights). The stacks are float32 or
 * bfloat16, the rows float32 or bfloat16, everything summed in float32: shrink over k in order, expand over
 * the rank in order, so a row's result never depends on the rows beside it or on the thread count.
 * Rows in no segment (the base model's requests) are never touched. Reference: lora.py's add_lora.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MB 4   /* rows of a tile: each weight vector loaded is used by this many rows */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VW 16
typedef __m512 vf;
static inline vf vload(const void *p, int bf16, long n) {   /* n (1..VW) lanes, zeros above */
    __mmask16 m = n >= VW ? 0xffff : (__mmask16)((1u << n) - 1);
    if (bf16) return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_maskz_loadu_ps(m, p);
}
static inline void vstore(void *p, int bf16, long n, vf v) {
    __mmask16 m = n >= VW ? 0xffff : (__mmask16)((1u << n) - 1);
    if (!bf16) { _mm512_mask_storeu_ps(p, m, v); return; }
#ifdef __AVX512BF16__
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
#else   /* round to nearest even, as f32_to_bf16 (NaNs aside) */
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
    _mm256_mask_storeu_epi16(p, m, h);
}
#define VZERO _mm512_setzero_ps
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
#else   /* AVX2 + FMA: partial vectors through a buffer */
#define VW 8
typedef __m256 vf;
static inline vf vload(const void *p, int bf16, long n) {
    if (n >= VW) return bf16 ? bf16x8_to_f32(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps(p);
    float tmp[VW] = {0};
    for (long i = 0; i < n; i++) tmp[i] = bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
    return _mm256_loadu_ps(tmp);
}
static inline void vstore(void *p, int bf16, long n, vf v) {
    if (!bf16 && n >= VW) { _mm256_storeu_ps(p, v); return; }
    float tmp[VW];
    _mm256_storeu_ps(tmp, v);
    for (long i = 0; i < n && i < VW; i++) {
        if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(tmp[i]);
        else ((float *)p)[i] = tmp[i];
    }
}
#define VZERO _mm256_setzero_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
#endif

typedef struct {
    long first, rows, slot, rank;   /* first: the tile's first row in the compact scratch; rank: the adapter's */
} Tile;

static inline long min_l(long a, long b) { return a < b ? a : b; }

#if VW == 16
#define NV 4   /* vectors of columns a micro-kernel holds per row: MB x NV accumulators of the 32 zmm */
#else
#define NV 2   /* of the 16 ymm */
#endif

/* acc[i][v] (i < mr, v < nv) = sum over k < K of x[i][k] * w[k][v * VW ...], w's rows `stride` elements apart,
 * the last vector `last` lanes wide. mr, nv and bf16 are constants where this is inlined: the loops unroll and
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void
micro(const int mr, const int nv, const int bf16, const float *x, long x_stride, const char *w, long stride, long K,
      long last, vf acc[MB][NV]) {
    const long el = bf16 ? 2 : 4;
    /* local, its address never taken, and every loop over it unrolled (the pragmas: without them gcc 12 kept c on
     * the stack and stored every accumulator each k, 16 stores a step beside 16 FMAs: 1.7x the time) */
    vf c[MB][NV];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) c[i][v] = VZERO();
    for (long k = 0; k < K; k++) {
        const char *row = w + el * k * stride;
        vf wv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) wv[v] = vload(row + el * VW * v, bf16, v + 1 < nv ? VW : last);
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            vf xv = VSET1(x[i * x_stride + k]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) c[i][v] = VFMA(xv, wv[v], c[i][v]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[i][v] = c[i][v];
}

#define MICRO_CASE(MR, NVV)                                                                         \
    case (MR) * 8 + (NVV):                                                                          \
        if (bf16) micro(MR, NVV, 1, x, x_stride, w, stride, K, last, acc);                         \
        else micro(MR, NVV, 0, x, x_stride, w, stride, K, last, acc);                              \
        break;

/* micro() for a run-time mr (1..MB) and nv (1..NV), each combination its own unrolled copy. */
static void micro_any(int mr, int nv, int bf16, const float *x, long x_stride, const char *w, long stride, long K,
                      long last, vf acc[MB][NV]) {
    switch (mr * 8 + nv) {
        MICRO_CASE(1, 1) MICRO_CASE(2, 1) MICRO_CASE(3, 1) MICRO_CASE(4, 1)
        MICRO_CASE(1, 2) MICRO_CASE(2, 2) MICRO_CASE(3, 2) MICRO_CASE(4, 2)
#if NV == 4
        MICRO_CASE(1, 3) MICRO_CASE(2, 3) MICRO_CASE(3, 3) MICRO_CASE(4, 3)
        MICRO_CASE(1, 4) MICRO_CASE(2, 4) MICRO_CASE(3, 4) MICRO_CASE(4, 4)
#endif
    }
}

/* t[rows, the adapter's rank columns of each module] = xf[rows, K] @ A[K, R]. Modules whose columns meet
 * (an adapter of the full rank) are one run, NV vectors at a time. */
static void shrink_tile(const float *xf, long K, const char *a, int w_bf16, long R, const long *blocks, long nb,
                        const Tile *tile, float *t) {
    const long el = w_bf16 ? 2 : 4;
    for (long b = 0; b < nb; b++) {
        long at = blocks[3 * b], end = at + tile->rank;
        while (b + 1 < nb && blocks[3 * (b + 1)] == end) end = blocks[3 * ++b] + tile->rank;   /* columns that meet */
        for (long j = at; j < end; j += NV * VW) {
            const long n = min_l(NV * VW, end - j), nv = (n + VW - 1) / VW, last = n - (nv - 1) * VW;
            vf acc[MB][NV];
            micro_any((int)tile->rows, (int)nv, w_bf16, xf + tile->first * K, K, a + el * j, R, K, last, acc);
            for (int i = 0; i < tile->rows; i++)
                for (int v = 0; v < nv; v++)
                    vstore(t + (tile->first + i) * R + j + v * VW, 0, v + 1 < nv ? VW : last, acc[i][v]);
        }
    }
}

#define CHUNK (NV * VW)   /* output columns of one expand task */

/* out[rows, c0:c0+n] += t[rows, at:at+rank] @ B[at:at+rank, c0:c0+n], n <= CHUNK. */
static void expand_tile(const float *t, long R, const char *b, int w_bf16, long N, long at, long c0, long n,
                        const Tile *tile, const long *row_of, char *out, long out_stride, int act_bf16) {
    const long el = w_bf16 ? 2 : 4, out_el = act_bf16 ? 2 : 4;
    const long nv = (n + VW - 1) / VW, last = n - (nv - 1) * VW;
    vf acc[MB][NV];
    micro_any((int)tile->rows, (int)nv, w_bf16, t + tile->first * R + at, R, b + el * (at * N + c0), N, tile->rank,
              last, acc);
    for (int i = 0; i < tile->rows; i++) {
        char *o = out + out_el * (row_of[tile->first + i] * out_stride + c0);
        for (int v = 0; v < nv; v++) {
            const long lanes = v + 1 < nv ? VW : last;
            vstore(o + out_el * VW * v, act_bf16, lanes, VADD(vload(o + out_el * VW * v, act_bf16, lanes), acc[i][v]));
        }
    }
}

/* A chunk's B (rank rows of up to CHUNK columns, N apart) into L2: with many adapters each slot's B is read by one
 * tile of a row or two, from memory, as `rank` streams at once; the next tile's chunk is fetched while this one
 * multiplies, so its B comes in as the current tile's did, one chunk at a time. */
static void prefetch_chunk(const char *b, int w_bf16, long N, const long *chunk, long rank) {
    const long el = w_bf16 ? 2 : 4;
    const char *at = b + el * (chunk[0] * N + chunk[1]);
    for (long k = 0; k < rank; k++)
        for (long l = 0; l < el * chunk[2]; l += 64) _mm_prefetch(at + el * k * N + l, _MM_HINT_T1);
}

/* x [*, K] (row stride x_stride) and out [*, *] (row stride out_stride, the group's N columns from `out`)
 * in float32, or bfloat16 when act_bf16; a [slots, K, R] and b [slots, R, N] in float32, or bfloat16 when
 * w_bf16. segments [n_segments][4]: rows start..end read slot `slot`, whose adapter has rank `rank` (at most
 * the blocks' spacing). blocks [n_blocks][3]: (rank_at, out_at, width). Returns 0, or -1 out of memory. */
int matinee_lora_add(const void *x, long x_stride, void *out, long out_stride, int act_bf16, const void *a,
                     const void *b, int w_bf16, long K, long R, long N, const long *segments, long n_segments,
                     const long *blocks, long n_blocks, int threads) {
    long rows = 0, chunks = 0;
    for (long s = 0; s < n_segments; s++)
        if (segments[4 * s + 3] > 0 && segments[4 * s + 1] > segments[4 * s]) rows += segments[4 * s + 1] - segments[4 * s];
    for (long bl = 0; bl < n_blocks; bl++) chunks += (blocks[3 * bl + 2] + CHUNK - 1) / CHUNK;
    if (rows == 0 || chunks == 0) return 0;
    float *xf = malloc(sizeof(float) * rows * (K + R) + 64);
    Tile *tile = malloc(sizeof(Tile) * rows + sizeof(long) * (rows + 3 * chunks + n_segments));
    if (xf == NULL || tile == NULL) { free(xf); free(tile); return -1; }
    float *t = xf + rows * K;
    long *row_of = (long *)(tile + rows), *chunk = row_of + rows, *order = chunk + 3 * chunks;
    const long w_el = w_bf16 ? 2 : 4, x_el = act_bf16 ? 2 : 4;
    /* The segments by slot (stable): a batch in arrival order holds one adapter's rows apart (round robin
     * over adapters gives one-row segments), and each slot's weights are then read once per MB rows. */
    for (long s = 0; s < n_segments; s++) {
        long j = s;
        for (; j > 0 && segments[4 * order[j - 1] + 2] > segments[4 * s + 2]; j--) order[j] = order[j - 1];
        order[j] = s;
    }
    long first = 0, tiles = 0, run = 0, slot = -1, rank = 0;
    for (long o = 0; o < n_segments; o++) {
        const long *seg = segments + 4 * order[o];
        if (seg[3] <= 0 || seg[1] <= seg[0]) continue;
        if (seg[2] != slot && run) tile[tiles++] = (Tile){first - run, run, slot, rank}, run = 0;
        slot = seg[2], rank = seg[3];
        for (long r = seg[0]; r < seg[1]; r++, first++) {
            row_of[first] = r;
            const char *src = (const char *)x + x_el * r * x_stride;
            float *dst = xf + first * K;
            if (act_bf16) for (long k = 0; k < K; k++) dst[k] = bf16_to_f32(((const uint16_t *)src)[k]);
            else memcpy(dst, src, sizeof(float) * K);
            if (++run == MB) tile[tiles++] = (Tile){first + 1 - run, run, slot, rank}, run = 0;
        }
    }
    if (run) tile[tiles++] = (Tile){first - run, run, slot, rank};
    long n = 0;
    for (long bl = 0; bl < n_blocks; bl++)
        for (long c = 0; c < blocks[3 * bl + 2]; c += CHUNK)
            chunk[3 * n] = blocks[3 * bl], chunk[3 * n + 1] = blocks[3 * bl + 1] + c,
            chunk[3 * n + 2] = min_l(CHUNK, blocks[3 * bl + 2] - c), n++;
    const long slot_a = K * R * w_el, slot_b = R * N * w_el;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * (K + N) >= 32768)
    {
#pragma omp for schedule(static)
        for (long i = 0; i < tiles; i++)
            shrink_tile(xf, K, (const char *)a + tile[i].slot * slot_a, w_bf16, R, blocks, n_blocks, tile + i, t);
        /* a tile's chunks one after another: its slot's B rows are read as MB-row streams along the columns */
#pragma omp for schedule(static) collapse(2)
        for (long i = 0; i < tiles; i++)
            for (long c = 0; c < chunks; c++) {
                if (i + 1 < tiles && tile[i + 1].slot != tile[i].slot)   /* the next slot's part of this chunk */
                    prefetch_chunk((const char *)b + tile[i + 1].slot * slot_b, w_bf16, N, chunk + 3 * c,
                                   tile[i + 1].rank);
                expand_tile(t, R, (const char *)b + tile[i].slot * slot_b, w_bf16, N, chunk[3 * c],
                            chunk[3 * c + 1], chunk[3 * c + 2], tile + i, row_of, out, out_stride, act_bf16);
            }
    }
    free(xf);
    free(tile);
    return 0;
}
