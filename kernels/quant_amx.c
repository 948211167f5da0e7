/* y[M, N] = x[M, K] @ W[N, K]^T for bf16 x and a packed GGUF weight (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and the
 * K-quants Q4_K, Q5_K, Q6_K, IQ4_XS; quant_layout.h, kquant.py), on AMX's bf16 tiles.
 *
 * quant_gemm.c's int8 products run on VNNI: right where a step reads each weight byte once for a few rows.
 * From a few dozen rows on, the arithmetic dominates, and AMX multiplies 16 x 16 x 32 bf16 per instruction.
 * Each thread widens two 16-row groups of the weight at a time into its own bf16 buffer in the tiles' pair
 * layout (K x 128 bytes: within L2), then multiplies every pair of 16-row tiles of x by them (2 x 2 tiles,
 * x's read where they lie); the next two groups are widened while the first pair of x's tiles multiplies,
 * and each 32 x 32 block of products goes to y while the next block multiplies. x taller than half an L2
 * goes in parts; a thread whose widened groups fit KEEP_BYTES widens them in the first part only.
 * The weight is widened once per call, never kept past it: the model holds only the packed bytes. x of at most
 * three tiles (a decode step's batch) takes all of them against each pair of groups at once instead, the
 * weight widened a block at a time into L1 (multiply_few).
 *
 * A value is widened as quant_linear.dequantize computes it in float32 (d * q, plus m for Q4_1 and Q5_1,
 * rounded apart), then rounded to the nearest even bf16, as torch rounds: the product is x times exactly
 * dequantize(W).bfloat16(), summed in float32 in the tiles, plus the bias, rounded to bf16 once.
 *
 * The B tile of one block (32 values of 16 rows) is 16 rows of 64 bytes: row p holds, for each weight row
 * n, the bf16 pair of columns 2p and 2p + 1. A packed block gives one weight row per int32 lane (its
 * 4-byte columns [v][row][4]), so the widening runs on 16 rows at once, a column at a time. A K-quant group is a
 * super-block of 256 values: its block b (32 values) is sub-block b % 8 of super-block b / 8, widened with that
 * sub-block's scales (widen_kblock).
 *
 * A bf16 weight in packed_linear.py's layout (BF16P: 32 columns a block, each k's 32 values together, columns c and
 * 16 + c in one 4-byte lane) is the degenerate case: its "widening" only pairs k with k + 1 for each column, one
 * block of 32 columns giving both groups of a pair (widen_bf16_pair); so bf16 weights take the tiles without a
 * second copy in the tiles' layout.
 *
 * Without the kernel's permission for the tiles (amx.h), or in a build for a CPU without AMX,
 * matinee_quant_amx returns -4 and the caller keeps quant_gemm.c.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "quant_layout.h"

#ifdef AMX_BF16
#define STREAM_BYTES (1L << 20)             /* outputs larger than this are written past the cache */
#define X_BYTES (1L << 20)                  /* x's rows a call multiplies at once: half an L2 */
#ifndef KEEP_BYTES
#define KEEP_BYTES (1L << 20)               /* a thread's widened pairs up to this size serve every part (2 MB:
                                               the same) */
#endif
#define KC_BLOCKS 64                        /* K in chunks of at most this many blocks (2048 values): a pair's
                                               widened chunk and x's rows of it share L2 (K = 8192 whole: 2.4x
                                               slower at 256 rows) */
#ifndef COPY_PAIRS
#define COPY_PAIRS 32                       /* a thread with this many pairs of groups copies x's tiles */
#endif

/* Two columns of 16 weight rows (float32) -> one B tile row: the bf16 pair of each row, in lane order. */
static inline void pair_row(__m512 even, __m512 odd, uint16_t *row) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);   /* words 0-15: even, 16-31: odd */
    _mm512_store_si512((void *)row, _mm512_permutexvar_epi16(interleave, both));
}

/* Byte k of each 4-byte lane moved to the lane's byte 3, the rest zero: the byte converts as itself times 2^24. */
static inline __m512i byte_on_top(__m512i v, int k) {
    return _mm512_shuffle_epi8(v, _mm512_set4_epi32(12 + k << 24 | 0x808080, 8 + k << 24 | 0x808080,
                                                    4 + k << 24 | 0x808080, k << 24 | 0x808080));
}

/* One group's block (16 weight rows x 32 columns) -> its B tile, 16 rows of 64 bytes at `tile`.
 *
 * Every d * q is exact in float32 (d is a float16, 11 significant bits; q has at most 8), so one fused
 * d * q + m rounds as dequantize's product-then-sum does, and for Q4_0 and Q5_0 d * (q - 8) is exact as
 * fma(q, d, -8d). A nibble is not shifted down: masked where it lies, q * 2^s converts exactly and meets d
 * * 2^-s (exact too), so a column costs a mask, a conversion and an fma. (A float16 scale of inf or NaN,
 * which no quantizer writes, may come out as NaN where dequantize gives inf.) */
/* IQ4's 16 levels (IQ4_LEVELS) as float32: a lane's nibble at bits 0-3 picks its level in one permute, which
 * reads only those bits of each lane. */
static inline __m512 iq4_levels(void) {
    static const int8_t levels[16] = IQ4_LEVELS;
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)levels)));
}

/* Four columns of IQ4 nibbles (byte k of each lane: column 4c + k low, 16 + 4c + k high) times each row's scale
 * -> B tile rows 2c, 2c + 1 (low) and 8 + 2c, 9 + 2c (high): scale * level, rounded once, as dequantize's. */
static inline void widen_iq4(__m512i raw, __m512 scale, __m512 levels, int c, uint16_t *tile) {
    __m512 lo[4], hi[4];
    for (int k = 0; k < 4; k++) {
        lo[k] = _mm512_mul_ps(scale, _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 8 * k), levels));
        hi[k] = _mm512_mul_ps(scale, _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 8 * k + 4), levels));
    }
    pair_row(lo[0], lo[1], tile + (2 * c) * 32);
    pair_row(lo[2], lo[3], tile + (2 * c + 1) * 32);
    pair_row(hi[0], hi[1], tile + (8 + 2 * c) * 32);
    pair_row(hi[2], hi[3], tile + (8 + 2 * c + 1) * 32);
}

static void widen_block(int type, const uint8_t *blk, uint16_t *tile) {
    const int has_min = type == Q4_1 || type == Q5_1;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const uint8_t *qs = blk + (has_min ? 4 * GR : 2 * GR);
    if (type == IQ4_NL) {   /* Q4_0's nibbles, each a level: d * level */
        const __m512 levels = iq4_levels();
        for (int c = 0; c < 4; c++) widen_iq4(_mm512_loadu_si512((const void *)(qs + c * GR * 4)), d, levels, c, tile);
        return;
    }
    if (type == Q8_0) {   /* vector v: columns 4v..4v+3, one signed byte each, moved to the top of the lane */
        const __m512 d24 = _mm512_mul_ps(d, _mm512_set1_ps(0x1p-24f));
        for (int v = 0; v < 8; v++) {
            __m512i raw = _mm512_loadu_si512((const void *)(qs + v * GR * 4));
            __m512 col[4];
            for (int k = 0; k < 4; k++) col[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(byte_on_top(raw, k)), d24);
            pair_row(col[0], col[1], tile + (2 * v) * 32);
            pair_row(col[2], col[3], tile + (2 * v + 1) * 32);
        }
        return;
    }
    const __m512 m = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2 * GR)))
                             : _mm512_mul_ps(d, _mm512_set1_ps(type == Q4_0 ? -8.f : -16.f));
    if (type == Q4_0 || type == Q4_1) {   /* byte k of vector c: column 4c + k low, 16 + 4c + k high */
        __m512 ds[8];   /* d * 2^-4i: the scale of a nibble left at bit 4i */
        ds[0] = d;
        for (int i = 1; i < 8; i++) ds[i] = _mm512_mul_ps(d, _mm512_set1_ps(1.f / (float)(1u << 4 * i)));
        for (int c = 0; c < 4; c++) {
            __m512i raw = _mm512_loadu_si512((const void *)(qs + c * GR * 4));
            __m512 lo[4], hi[4];
            for (int k = 0; k < 4; k++) {
                __m512i a = _mm512_and_si512(raw, _mm512_set1_epi32(0xf << 8 * k));
                __m512i b = _mm512_and_si512(raw, _mm512_set1_epi32((int)(0xf0u << 8 * k)));
                lo[k] = _mm512_fmadd_ps(_mm512_cvtepu32_ps(a), ds[2 * k], m);
                hi[k] = _mm512_fmadd_ps(_mm512_cvtepu32_ps(b), ds[2 * k + 1], m);
            }
            pair_row(lo[0], lo[1], tile + (2 * c) * 32);
            pair_row(lo[2], lo[3], tile + (2 * c + 1) * 32);
            pair_row(hi[0], hi[1], tile + (8 + 2 * c) * 32);
            pair_row(hi[2], hi[3], tile + (8 + 2 * c + 1) * 32);
        }
        return;
    }
    const __m512i low = _mm512_set1_epi32(15), fifth = _mm512_set1_epi32(16);   /* Q5_0 and Q5_1 */
    const __m512i qh = _mm512_loadu_si512((const void *)qs);
    for (int c = 0; c < 4; c++) {   /* as Q4's, each column's fifth bit in bit j of qh */
        __m512i raw = _mm512_loadu_si512((const void *)(qs + GR * 4 + c * GR * 4));
        __m512 lo[4], hi[4];
        for (int k = 0; k < 4; k++) {
            const int j = 4 * c + k;
            __m512i a = _mm512_and_si512(_mm512_srli_epi32(raw, 8 * k), low);
            __m512i b = _mm512_and_si512(_mm512_srli_epi32(raw, 8 * k + 4), low);
            a = _mm512_or_si512(a, _mm512_and_si512(_mm512_slli_epi32(_mm512_srli_epi32(qh, j), 4), fifth));
            b = _mm512_or_si512(b, _mm512_and_si512(_mm512_slli_epi32(_mm512_srli_epi32(qh, 16 + j), 4), fifth));
            lo[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), d, m);
            hi[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), d, m);
        }
        pair_row(lo[0], lo[1], tile + (2 * c) * 32);
        pair_row(lo[2], lo[3], tile + (2 * c + 1) * 32);
        pair_row(hi[0], hi[1], tile + (8 + 2 * c) * 32);
        pair_row(hi[2], hi[3], tile + (8 + 2 * c + 1) * 32);
    }
}

/* Sub-block j (values 32j..32j + 31) of a Q4_K or Q5_K super-block of 16 rows (kquant.py's group) -> its B tile.
 * w = d * sc[j] * q - dmin * m[j] as kquant.dequantize_raw computes it: d * sc and dmin * m are exact in float32
 * (11 and 6 significant bits), so is q times the first (at most 22 bits), and one fma rounds q * scale - min as
 * the product-then-difference does. Value 32j + l is nibble j % 2 of the file's byte 32(j / 2) + l, l = 4c + k:
 * byte k of vector 8(j / 2) + c; Q5_K's fifth bit is bit j of byte l of its 32 (vector c of eight, byte k). */
static void widen_k45(int type, const uint8_t *g, int j, uint16_t *tile) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 2 * GR)));
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(g + 4 * GR + j * GR))));
    const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(g + 12 * GR + j * GR))));
    const __m512 scale = _mm512_mul_ps(d, sc), low = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, mn));
    const uint8_t *qs = g + 20 * GR + (j / 2) * 8 * GR * 4, *qh = g + 20 * GR + 128 * GR;
    const int nib = 4 * (j & 1);
    __m512 ds[4];   /* Q4_K: the scale moved down to meet a nibble left at bit 8k + nib (exact) */
    for (int k = 0; k < 4; k++) ds[k] = _mm512_mul_ps(scale, _mm512_set1_ps(1.f / (float)(1ul << (8 * k + nib))));
    for (int c = 0; c < 8; c++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(qs + c * GR * 4));
        __m512 col[4];
        if (type == Q4_K) {   /* the nibble masked where it lies, meeting ds[k] */
            for (int k = 0; k < 4; k++) {
                const __m512i q = _mm512_and_si512(raw, _mm512_set1_epi32((int)(0xfu << (8 * k + nib))));
                col[k] = _mm512_fmadd_ps(_mm512_cvtepu32_ps(q), ds[k], low);
            }
        } else {
            const __m512i high = _mm512_loadu_si512((const void *)(qh + c * GR * 4));
            for (int k = 0; k < 4; k++) {
                __m512i q = _mm512_and_si512(_mm512_srli_epi32(raw, 8 * k + nib), _mm512_set1_epi32(15));
                q = _mm512_or_si512(q, _mm512_and_si512(_mm512_slli_epi32(_mm512_srli_epi32(high, 8 * k + j), 4),
                                                        _mm512_set1_epi32(16)));
                col[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, low);
            }
        }
        pair_row(col[0], col[1], tile + (2 * c) * 32);
        pair_row(col[2], col[3], tile + (2 * c + 1) * 32);
    }
}

/* Block b (values 32b..32b + 31) of a Q6_K super-block of 16 rows -> its B tile. w = d * sc * (q - 32): d * sc is
 * exact (11 and 8 bits), its product with q - 32 rounded once, as kquant.dequantize_raw's. Column 4c + k is the low
 * nibble of byte k of low vector c, 16 + 4c + k its high one (scales 2b and 2b + 1); their two high bits lie in
 * byte k of high vector c / 2, at bit 4(c % 2) and 2 + 4(c % 2). Each byte's two 6-bit values are assembled for
 * the 64 bytes of a vector at once; a column's byte k is moved to the top of its lane, where it converts exactly
 * as q * 2^24, and one fma with the scale times 2^-24 and -32 times the scale rounds (q - 32) * scale once (as
 * Q8_0's). Assembled a lane at a time, 16 values an op, this took three times Q4_K's time per value. */
static void widen_q6k(const uint8_t *g, int b, uint16_t *tile) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    __m512 s24[2], off[2];   /* for columns 0-15 and 16-31: the scale times 2^-24, and times -32 */
    for (int x = 0; x < 2; x++) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(g + 2 * GR + (2 * b + x) * GR));
        const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        s24[x] = _mm512_mul_ps(scale, _mm512_set1_ps(0x1p-24f));
        off[x] = _mm512_mul_ps(scale, _mm512_set1_ps(-32.f));
    }
    const uint8_t *ql = g + 18 * GR + b * 4 * GR * 4, *qh = g + 18 * GR + 128 * GR + b * 2 * GR * 4;
    const __m512i nibble = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x30);
    for (int c = 0; c < 4; c++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(ql + c * GR * 4));
        const __m512i high = _mm512_srli_epi16(_mm512_loadu_si512((const void *)(qh + (c / 2) * GR * 4)), 4 * (c & 1));
        /* (x & nibble) | y, y's bits 4-5 alone: ternary logic 0xEC on (x, y, nibble) */
        const __m512i lo = _mm512_ternarylogic_epi32(raw, _mm512_and_si512(_mm512_slli_epi16(high, 4), two), nibble, 0xEC);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), _mm512_and_si512(_mm512_slli_epi16(high, 2), two),
                                                     nibble, 0xEC);
        __m512 a[4], e[4];
        for (int k = 0; k < 4; k++) {
            a[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(byte_on_top(lo, k)), s24[0], off[0]);
            e[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(byte_on_top(hi, k)), s24[1], off[1]);
        }
        pair_row(a[0], a[1], tile + (2 * c) * 32);
        pair_row(a[2], a[3], tile + (2 * c + 1) * 32);
        pair_row(e[0], e[1], tile + (8 + 2 * c) * 32);
        pair_row(e[2], e[3], tile + (8 + 2 * c + 1) * 32);
    }
}

/* Values k = 32b.. of a packed bf16 block (32 columns; k's 32 values are columns 0, 16, 1, 17, ..., as 16 lanes of
 * 4 bytes) -> the B tiles of its two groups: row p of the first holds column n's k = 2p and 2p + 1 in lane n, the
 * low halves of rows 2p and 2p + 1's lanes; the second their high halves. */
__attribute__((noinline)) static void widen_bf16_pair(const uint16_t *blk, uint16_t *t0, uint16_t *t1) {
    for (int p = 0; p < 16; p++) {
        const __m512i a = _mm512_loadu_si512((const void *)(blk + 2 * p * 32));
        const __m512i b = _mm512_loadu_si512((const void *)(blk + (2 * p + 1) * 32));
        _mm512_store_si512((void *)(t0 + p * 32), _mm512_mask_blend_epi16(0xAAAAAAAAu, a, _mm512_slli_epi32(b, 16)));
        _mm512_store_si512((void *)(t1 + p * 32), _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(a, 16), b));
    }
}

/* Sub-block j (values 32j..32j + 31) of an IQ4_XS super-block of 16 rows -> its B tile: (d * sc) * level, d * sc
 * exact (11 and 7 bits), as kquant.dequantize_raw's. Vector c of the sub-block: bytes 4c + k, as IQ4_NL's. */
static void widen_iq4xs(const uint8_t *g, int j, uint16_t *tile) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    const __m512 scale = _mm512_mul_ps(
        d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(g + 2 * GR + j * GR)))));
    const __m512 levels = iq4_levels();
    const uint8_t *qs = g + 10 * GR + j * 4 * GR * 4;
    for (int c = 0; c < 4; c++) widen_iq4(_mm512_loadu_si512((const void *)(qs + c * GR * 4)), scale, levels, c, tile);
}

/* Block b of a group (16 rows of the whole of K) -> its B tile; gb: a block's bytes, a super-block's for a K-quant. */
static void widen_group_block(int type, const uint8_t *group, long gb, long b, uint16_t *tile) {
    if (type == Q6_K) widen_q6k(group + b / 8 * gb, (int)(b % 8), tile);
    else if (type == IQ4_XS) widen_iq4xs(group + b / 8 * gb, (int)(b % 8), tile);
    else if (is_k(type)) widen_k45(type, group + b / 8 * gb, (int)(b % 8), tile);
    else widen_block(type, group + b * gb, tile);
}

/* The pair of groups a thread widens while its tiles multiply the pair before: their packed blocks (w1 NULL
 * past the last group, whose tiles stay zero) and their B tiles. */
typedef struct {
    int type;
    long gb;   /* a block's bytes (a super-block's for a K-quant) */
    const uint8_t *w0, *w1;
    uint16_t *t0, *t1;
    long b0, blocks;   /* tile b (< blocks) holds block b0 + b: a chunk of K */
} Widening;

/* Groups g and g + 1 of w, to be widened (w1 NULL past the last group). */
static Widening pair_of(int type, const uint8_t *w, long gb, long nb, long groups, long g) {
    const long stride = (is_k(type) ? nb / 8 : nb) * gb;   /* a group's bytes */
    return (Widening){type, gb, w + g * stride, g + 1 < groups || type == BF16P ? w + (g + 1) * stride : NULL, NULL,
                      NULL, 0, nb};
}

/* The same, blocks [b0, b0 + kb) of them to be widened into `tiles` (the second group's kb * 1 KB after the
 * first's). */
static Widening pair_at(int type, const uint8_t *w, long gb, long nb, long groups, long g, long b0, long kb,
                        uint16_t *tiles) {
    Widening pair = pair_of(type, w, gb, nb, groups, g);
    pair.t0 = tiles;
    pair.t1 = tiles + kb * 16 * 32;
    pair.b0 = b0;
    pair.blocks = kb;
    if (!pair.w1) memset(pair.t1, 0, (size_t)kb * 16 * 64);
    return pair;
}

/* Blocks widened ahead of the one fetched into L1: a quantized group's blocks are read with gaps (a K-quant's 32
 * values lie in pieces across its super-block), which the hardware prefetchers did not run ahead of. The 1B
 * Llama shape's Q4_K_M decode step at 48 rows: 150 -> 111-120 ms, its widening two thirds of the step before,
 * stalled on these loads. (A bf16 weight, read in order, measured no faster for it.) */
#define FETCH_AHEAD 8

/* widen_to for a quantized weight, with block b + FETCH_AHEAD's bytes fetched. Out of line: the same fetches
 * inlined into the few-row loop measured 147-155 ms for that Q4_K_M step, against 111-116. */
__attribute__((noinline)) static void widen_quantized(const Widening *pair, long b, uint16_t *t0, uint16_t *t1) {
    const long eight = is_k(pair->type) ? pair->gb : 8 * pair->gb;   /* the bytes of 8 blocks of a group */
    for (long o = ((b + FETCH_AHEAD) * eight / 8) & ~63L; o < (b + FETCH_AHEAD + 1) * eight / 8; o += 64) {
        _mm_prefetch((const char *)pair->w0 + o, _MM_HINT_T0);
        if (pair->w1) _mm_prefetch((const char *)pair->w1 + o, _MM_HINT_T0);
    }
    widen_group_block(pair->type, pair->w0, pair->gb, b, t0);
    if (pair->w1) widen_group_block(pair->type, pair->w1, pair->gb, b, t1);
}

/* Block b of the pair's two groups -> B tiles at t0 and t1 (t1 untouched past the last group). Each kind out
 * of line: a bf16 pair's widening inlined into the few-row loop, or sharing a call with the quantized one's
 * fetches, measured 143-148 ms for the 1B bf16 step at 48 rows, against 134-140. */
static inline void widen_to(const Widening *pair, long b, uint16_t *t0, uint16_t *t1) {
    if (pair->type == BF16P)   /* both groups from one block of the packed layout, zero columns past N */
        widen_bf16_pair((const uint16_t *)pair->w0 + b * 32 * 32, t0, t1);
    else
        widen_quantized(pair, b, t0, t1);
}

static void widen(const Widening *next, long b) {
    widen_to(next, next->b0 + b, next->t0 + b * 16 * 32, next->t1 + b * 16 * 32);
}

/* A 32 x 32 block of float32 products (row stride 32) on its way to y: rows x cols of it, + bias, rounded to
 * the nearest even bf16 into y (row stride N). `stream`: whole lines bypass the cache (an output larger than L2
 * written a column strip at a time otherwise reads every line it writes). */
typedef struct {
    const float *out;
    int rows, cols, stream;
    const float *bias;
    uint16_t *y;
    long N;
} Emission;

static void emit(const Emission *e, int from, int to) {
    const int cols = e->cols;
    const __mmask32 mask = (__mmask32)(cols >= 32 ? 0xffffffffu : (1u << cols) - 1);
    const __m512 b0 = e->bias ? _mm512_maskz_loadu_ps((__mmask16)mask, e->bias) : _mm512_setzero_ps();
    const __m512 b1 = e->bias ? _mm512_maskz_loadu_ps((__mmask16)(mask >> 16), e->bias + 16) : _mm512_setzero_ps();
    for (int r = from; r < to && r < e->rows; r++) {
        __m512 lo = _mm512_add_ps(_mm512_loadu_ps(e->out + r * 32), b0);
        __m512 hi = _mm512_add_ps(_mm512_loadu_ps(e->out + r * 32 + 16), b1);
        __m512i v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        uint16_t *to_row = e->y + r * e->N;
        if (e->stream && cols == 32 && ((uintptr_t)to_row & 63) == 0)
            _mm512_stream_si512((void *)to_row, v);
        else
            _mm512_mask_storeu_epi16(to_row, mask, v);
    }
}

/* Where a pair of 16-row tiles of x is read: block b of tile i at a[i] + b * step, its rows `stride` bytes
 * apart; with `copy`, stored there too as it is loaded (tile i's block b at copy[i] + b * 512 values), for the
 * thread's later pairs of groups to read 1 KB at a time. */
typedef struct {
    const uint16_t *a[2];
    long stride, step;
    uint16_t *copy[2];
} XTiles;

/* Rows 16t.. of x as they lie (x in place, or `tail`: rows past the last whole 32, with zeros after them). */
static XTiles in_place(const uint16_t *x, const uint16_t *tail, long M, long K, long t) {
    const uint16_t *a0 = t * 16 + 32 <= M ? x + t * 16 * K : tail;
    return (XTiles){{a0, a0 + 16 * K}, 2 * K, 32, {NULL, NULL}};
}

/* The same tiles in a thread's copy (`copy`'s layout): each 1 KB block contiguous. */
static XTiles in_copy(const uint16_t *mine, long K, long t) {
    const uint16_t *a0 = mine + t * 16 * K;
    return (XTiles){{a0, a0 + 16 * K}, 64, 16 * 32, {NULL, NULL}};
}

/* Two 16-row tiles of x times two widened groups (nb B tiles each at w0 and w1: blocks b0.. of K) -> out[32][32]
 * float32: C tile 2i + j is x tile i times group j, plus `init` where not NULL (the sums of K's chunks before).
 * The vector units work while the tile unit multiplies, a share after each block's products are issued:
 * with `next`, block b of the next pair is widened (at 32 rows the widening took as long as the products
 * and more); with `done`, the block multiplied before this one goes to y. (Read back right after its tile
 * stores, a block's floats stalled the emission: 17% of a 2048-row call.) */
static void multiply(const XTiles *x, const uint16_t *w0, const uint16_t *w1, long nb, long b0, const float *init,
                     float *out, const Widening *next, const Emission *done) {
    const int share = (int)((32 + nb - 1) / nb);   /* rows of `done` emitted a block */
    if (init) {
        _tile_loadd(0, init, 128);
        _tile_loadd(1, init + 16, 128);
        _tile_loadd(2, init + 512, 128);
        _tile_loadd(3, init + 512 + 16, 128);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (long b = 0; b < nb; b++) {
        /* each product as soon as its two tiles are in (all four loads first: 6% slower at 512 rows). x's tiles
         * are loaded with the hint that they are not reused soon: each passes once while the widened groups
         * (2 x 18 KB at K = 576) are read again for every pair of x's tiles, and a plain load let x's lines
         * push them out of L1 (7.5 -> 5.6 ns a product at K = 576). */
        _tile_stream_loadd(4, x->a[0] + (b0 + b) * x->step, x->stride);
        _tile_loadd(6, w0 + b * 16 * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w1 + b * 16 * 32, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_stream_loadd(5, x->a[1] + (b0 + b) * x->step, x->stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (x->copy[0]) {
            _tile_stored(4, x->copy[0] + (b0 + b) * 16 * 32, 64);
            _tile_stored(5, x->copy[1] + (b0 + b) * 16 * 32, 64);
        }
        if (next && b < next->blocks) widen(next, b);
        if (done) emit(done, (int)b * share, (int)(b + 1) * share);
    }
    for (long b = nb; next && b < next->blocks; b++) widen(next, b);   /* a next chunk longer than this one */
    _tile_stored(0, out, 128);
    _tile_stored(1, out + 16, 128);
    _tile_stored(2, out + 512, 128);
    _tile_stored(3, out + 512 + 16, 128);
}

/* What every thread of a call reads: the operands, their shapes, and how x is cut into parts. */
typedef struct {
    const uint16_t *x;
    int type, stream;
    const uint8_t *w;
    const float *bias;
    uint16_t *y;
    long M, N, K, nb, groups, gb, pairs, rows;   /* rows: of x in each part but the last (a multiple of 32) */
    long kc;                /* blocks of K in a chunk (all of them up to KC_BLOCKS) */
    const uint16_t *tail;   /* the rows past the last whole 32, zeros after them: no tile reads past x */
} Call;

/* One thread's pairs of groups [first, last) and its buffers. A unit is one pair's chunk of K; a part goes
 * through them chunk by chunk, every pair of a chunk before the next chunk (so x's chunk stays in L2 for all
 * the pairs). `wbuf` holds two units' B tiles, unit u + 1 widened into one while u multiplies in the other,
 * or with `keep` every unit's, widened in the first part only. `mine`: x's tiles as the first pair loads them,
 * for the later ones (COPY_PAIRS). `sums`: each pair's float32 sums of the chunks so far, for each pair of x's
 * tiles (with more than one chunk). */
typedef struct {
    long first, last;
    int keep, flip;
    uint16_t *wbuf, *mine;
    float *out;       /* one block multiplied, one emitted */
    float *sums;
    Emission done;    /* the block multiplied last, emitted while the next one multiplies */
} Share;

/* Rows [row, row + rows) of the products of groups g, g + 1 (at `out`, row stride 32), on their way to y. */
static Emission pair_emission(const Call *c, const float *out, long row, int rows, long g) {
    const int cols = c->N - g * GR < 2 * GR ? (int)(c->N - g * GR) : 2 * GR;
    return (Emission){out, rows, cols, c->stream, c->bias ? c->bias + g * GR : 0, c->y + row * c->N + g * GR, c->N};
}

/* Blocks in chunk q of K (the last may be short). */
static long chunk_blocks(const Call *c, long q) {
    return c->nb - q * c->kc < c->kc ? c->nb - q * c->kc : c->kc;
}

/* Where unit u's B tiles are in the thread's buffer. */
static uint16_t *slot(const Share *s, long kc, long u) {
    return s->wbuf + (s->keep ? u : u % 2) * 2 * kc * 16 * 32;
}

/* Unit u of a thread's share: its pair of groups and its chunk of K, widened into its slot. */
static Widening unit_at(const Call *c, const Share *s, long u) {
    const long pairs = s->last - s->first, q = u / pairs;
    return pair_at(c->type, c->w, c->gb, c->nb, c->groups, 2 * (s->first + u % pairs), q * c->kc, chunk_blocks(c, q),
                   slot(s, c->kc, u));
}

/* Rows [r, r + m) of x by the thread's pairs, into y. Out of line: inlined into the parallel region, the
 * same loops ran 3-4% slower at 512 rows. */
__attribute__((noinline)) static void multiply_part(const Call *c, Share *s, long r, long m) {
    const long nb = c->nb, kc = c->kc, K = c->K, tiles = (m + 15) / 16;
    const long pairs = s->last - s->first, chunks = (nb + kc - 1) / kc, units = pairs * chunks;
    const uint16_t *x = c->x + r * K;
    const int widened = s->keep && r > 0;
    Widening now = unit_at(c, s, 0), next = now;
    if (!widened)
        for (long b = 0; b < now.blocks; b++) widen(&now, b);
    for (long u = 0; u < units; u++) {
        const long p = s->first + u % pairs, q = u / pairs, g = 2 * p, b0 = q * kc, kb = chunk_blocks(c, q);
        const uint16_t *w0 = slot(s, kc, u), *w1 = w0 + kb * 16 * 32;
        const int more = !widened && u + 1 < units, last_chunk = q == chunks - 1;
        if (more) next = unit_at(c, s, u + 1);
        for (long t = 0; t < tiles; t += 2) {
            XTiles a = s->mine && p > s->first ? in_copy(s->mine, K, t) : in_place(x, c->tail, m, K, t);
            if (s->mine && p == s->first) {
                a.copy[0] = s->mine + t * 16 * K;
                a.copy[1] = a.copy[0] + 16 * K;
            }
            float *sums = chunks > 1 ? s->sums + ((p - s->first) * (c->rows / 32) + t / 2) * 1024 : NULL;
            float *out = last_chunk ? s->out + s->flip * 1024 : sums;
            multiply(&a, w0, w1, kb, b0, q > 0 ? sums : NULL, out, t == 0 && more ? &next : NULL,
                     s->done.rows ? &s->done : NULL);
            if (last_chunk) {
                s->done = pair_emission(c, out, r + t * 16, m - t * 16 < 32 ? (int)(m - t * 16) : 32, g);
                s->flip ^= 1;
            } else {
                s->done.rows = 0;   /* emitted during this chunk's products */
            }
        }
    }
}

/* Few rows (a decode step's batch): all of x's tiles (mt of 16 rows, at most FEW_TILES) against one pair of
 * groups at once, so the weight is read and widened exactly once, a block at a time into a ring of two in L1
 * (block b + 1 widened while block b's products run), and nothing larger than x stays in cache. The tiles
 * paths above widen a whole pair ahead into a buffer of K x 128 bytes and read it again for each pair of x's
 * tiles: at 48 rows of a 1B model's down projection (K = 8192) that buffer, x and its copy passed L2, and
 * the weight streamed at 12 GB/s where one row read it at 28. Six accumulators, one A and one B tile: an x
 * tile is loaded again for the second group (the last one loaded serves both). */
#define FEW_TILES 3

static inline __attribute__((always_inline)) void few_block(int mt, const uint16_t *a, long stride,
                                                            const uint16_t *b0, const uint16_t *b1) {
    const long tile = 16 * stride / 2;   /* values from one tile of x to the next */
    _tile_loadd(7, b0, 64);
    _tile_loadd(6, a, stride);
    _tile_dpbf16ps(0, 6, 7);
    if (mt > 1) {
        _tile_loadd(6, a + tile, stride);
        _tile_dpbf16ps(2, 6, 7);
    }
    if (mt > 2) {
        _tile_loadd(6, a + 2 * tile, stride);
        _tile_dpbf16ps(4, 6, 7);
    }
    _tile_loadd(7, b1, 64);
    if (mt > 2) _tile_dpbf16ps(5, 6, 7);
    if (mt > 1) {
        if (mt > 2) _tile_loadd(6, a + tile, stride);
        _tile_dpbf16ps(3, 6, 7);
        _tile_loadd(6, a, stride);
    }
    _tile_dpbf16ps(1, 6, 7);
}

/* One pair of groups (g, g + 1) by x's mt tiles (x: 16 mt rows, `stride` bytes apart) -> out [16 mt][32]. */
static inline __attribute__((always_inline)) void few_pair(int mt, const Call *c, const uint16_t *x, long stride,
                                                           long g, uint16_t *ring, float *out) {
    const long nb = c->nb;
    const Widening pair = pair_of(c->type, c->w, c->gb, nb, c->groups, g);
    if (!pair.w1) {   /* past the last group: its tiles stay zero */
        memset(ring + 512, 0, 1024);
        memset(ring + 1536, 0, 1024);
    }
    _tile_zero(0);
    _tile_zero(1);
    if (mt > 1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    if (mt > 2) {
        _tile_zero(4);
        _tile_zero(5);
    }
    widen_to(&pair, 0, ring, ring + 512);
    for (long b = 0; b < nb; b++) {
        const uint16_t *t = ring + (b & 1) * 1024;
        few_block(mt, x + b * 32, stride, t, t + 512);
        uint16_t *next = ring + ((b + 1) & 1) * 1024;
        if (b + 1 < nb) widen_to(&pair, b + 1, next, next + 512);
    }
    store_accumulators(mt, out);
}

static void multiply_few(const Call *c, const uint16_t *x, long stride, long first, long last, uint16_t *ring,
                         float *out) {
    const long mt = (c->M + 15) / 16;
    for (long p = first; p < last; p++) {
        const long g = 2 * p;
        if (mt == 1) few_pair(1, c, x, stride, g, ring, out);
        else if (mt == 2) few_pair(2, c, x, stride, g, ring, out);
        else few_pair(3, c, x, stride, g, ring, out);
        const Emission e = pair_emission(c, out, 0, (int)c->M, g);
        emit(&e, 0, (int)c->M);
    }
}

/* x of at most FEW_TILES tiles: read in place where its rows are whole tiles on 64-byte lines, else from a
 * copy padded with zero rows. */
static int few_rows(const Call *c, int threads) {
    const long M = c->M, K = c->K, mt = (M + 15) / 16;
    uint16_t *copy = NULL;
    const uint16_t *x = c->x;
    if (M % 16 || ((uintptr_t)x & 63)) {
        if (!(copy = aligned_alloc(64, (size_t)mt * 16 * K * 2))) return -1;
        memcpy(copy, x, (size_t)M * K * 2);
        memset(copy + M * K, 0, (size_t)(mt * 16 - M) * K * 2);
        x = copy;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const long first = c->pairs * omp_get_thread_num() / omp_get_num_threads();
        const long last = c->pairs * (omp_get_thread_num() + 1) / omp_get_num_threads();
        uint16_t *ring = aligned_alloc(64, 4 * 1024);
        float *out = aligned_alloc(64, (size_t)FEW_TILES * 16 * 32 * sizeof(float));
        if (!ring || !out) {
#pragma omp atomic write
            failed = 1;
        } else if (first < last) {
            configure_tiles();
            multiply_few(c, x, 2 * K, first, last, ring, out);
            _tile_release();
        }
        if (c->stream) _mm_sfence();
        free(ring);
        free(out);
    }
    free(copy);
    return failed ? -1 : 0;
}

int matinee_quant_amx(const uint16_t *x, int type, const uint8_t *w, const float *bias, uint16_t *y, long M, long N,
                      long K, int threads) {
    if (type != Q8_0 && type != Q4_0 && type != Q4_1 && type != Q5_0 && type != Q5_1 && type != IQ4_NL && type != Q4_K &&
        type != Q5_K && type != Q6_K && type != IQ4_XS && type != BF16P)
        return -2;
    if ((is_k(type) && K % QKK) || K % QK) return -2;
    if (!amx_permitted()) return -4;
    if (M <= 0) return 0;
    /* Every pair of groups reads all of x's tiles of a chunk of K: past L2 they come from memory each time (2048
     * x 576 rows cost 1.8x four times 512). So x goes in parts of at most X_BYTES a chunk, in whole pairs of
     * tiles (a last tile pair of 5 rows costs a full one); each part widens the weight again. */
    const long nb = K / QK, groups = (N + GR - 1) / GR, kc = nb < KC_BLOCKS ? nb : KC_BLOCKS;
    const long most = X_BYTES / (2 * kc * QK) / 32 * 32 > 32 ? X_BYTES / (2 * kc * QK) / 32 * 32 : 32;
    const long parts = (M + most - 1) / most, whole = M / 32 * 32, chunks = (nb + kc - 1) / kc;
    Call c = {x, type, M * N * 2 > STREAM_BYTES, w, bias, y, M, N, K, nb, groups, type == BF16P ? 16 * QK * 2 : group_bytes(type),
              (groups + 1) / 2, ((M + parts - 1) / parts + 31) / 32 * 32, kc, NULL};
    if (M <= FEW_TILES * 16) return few_rows(&c, threads);
    /* x's tiles are read where they lie (a copy cost more than it saved below COPY_PAIRS: o 576 x 576 at 512
     * rows 1.4x faster without) */
    uint16_t *tail = NULL;
    if (M > whole) {
        if (!(tail = aligned_alloc(64, (size_t)32 * K * 2))) return -1;
        memcpy(tail, x + whole * K, (size_t)(M - whole) * K * 2);
        memset(tail + (M - whole) * K, 0, (size_t)(32 - (M - whole)) * K * 2);
        c.tail = tail;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const long first = c.pairs * omp_get_thread_num() / omp_get_num_threads();
        const long last = c.pairs * (omp_get_thread_num() + 1) / omp_get_num_threads();
        const size_t unit_bytes = (size_t)2 * kc * 16 * 64, units = (size_t)(last - first) * chunks;
        Share s = {first, last, parts > 1 && units * unit_bytes <= KEEP_BYTES, 0};
        s.wbuf = aligned_alloc(64, (s.keep ? units : 2) * unit_bytes);
        s.out = aligned_alloc(64, 2 * 32 * 32 * sizeof(float));
        if (chunks > 1) s.sums = aligned_alloc(64, (size_t)(last - first) * (c.rows / 32) * 1024 * sizeof(float));
        /* in place, a tile's 16 rows are 2K bytes apart: its loads 5% slower than of 1 KB in a row. And rows of
         * x off 64 bytes (decode_layers.c's scratch lies 16 bytes past them) cross two lines a tile row: read in
         * place, 0.85x the repacking kernel's speed at 512 rows; so only the first pair reads those there. */
        const int copying = last - first >= COPY_PAIRS || (last - first > 1 && ((uintptr_t)x & 63));
        if (copying) s.mine = aligned_alloc(64, (size_t)c.rows * K * 2);
        const int ready = s.wbuf && s.out && (s.mine || !copying) && (s.sums || chunks == 1);
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        } else if (first < last) {
            configure_tiles();
            for (long r = 0; r < M; r += c.rows) multiply_part(&c, &s, r, M - r < c.rows ? M - r : c.rows);
            emit(&s.done, 0, s.done.rows);
            _tile_release();
        }
        if (c.stream) _mm_sfence();   /* the streamed lines are visible before the region ends */
        free(s.wbuf);
        free(s.out);
        free(s.mine);
        free(s.sums);
    }
    free(tail);
    return failed ? -1 : 0;
}
#else
int matinee_quant_amx(const uint16_t *x, int type, const uint8_t *w, const float *bias, uint16_t *y, long M, long N,
                      long K, int threads) {
    (void)x, (void)type, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return -4;   /* built for a CPU without AMX */
}
#endif
