/* y[M, N] = x[M, K] @ W[N, K]^T with W in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), repacked
 * once at load (quant_linear.py) and never widened to float in memory.
 *
 * x is quantized on the fly, per block of 32 values, to int8 with one float32 scale (amax / 127,
 * rounded to nearest even, as quant_linear.reference_matmul does), and each block's product is an
 * exact int32 dot product: u8 x s8 through vpdpbusd where the CPU has AVX-512 VNNI, maddubs + madd
 * on AVX2 (there a Q4 or Q5 block's maddubs pair sums are added in int16 while they fit, then widened
 * by one madd: 0.85-0.9x the time from 4 rows on a Zen 3). Q4 nibbles (0..15) and Q5 values (0..31)
 * are the unsigned operand; Q4_0's -8, Q5_0's -16 and Q8_0's +128 (its bytes are made unsigned by an
 * xor with 0x80 on VNNI) come back as -8, -16 or -128 times the block's sum of x, which the quantizer
 * counts once per row. IQ4_NL's nibbles index 16 signed levels (a byte shuffle, SHUF8), then multiply as Q8_0's
 * bytes do. The int32 sums are scaled per block in float32 and added
 * up block after block, in the order the torch reference adds them: the two agree bit for bit.
 *
 * The packed weight is [ceil(N/16), K/32, GROUP_BYTES]: 16 output rows (one int32 lane each) of one
 * 32-column block together: 16 float16 scales d, for Q4_1 and Q5_1 16 float16 minimums m, then the
 * values as 4-byte columns, [v][row][4]: Q8_0 has 8 vectors v (columns 4v..4v+3), Q4 4 vectors of bytes
 * whose low nibbles are columns 4v..4v+3 and high nibbles 16+4v.., as in the file's own blocks; Q5 has
 * its qh first (bit j: column j's fifth bit, a uint32 per row), then Q4's 4 vectors. Each column's four
 * fifth bits go to bit 4 of its four bytes by one multiply: (qh >> j) & 15 times 0x02040810 places bit
 * i at 8i + 4 (the four shifted copies do not overlap, so nothing carries).
 * One broadcast of 4 bytes of x multiplies 16 rows at once; a group's blocks are one stream.
 *
 * The K-quants (Q4_K, Q5_K, Q6_K, and IQ4_XS; kquant.py draws their group of one 256-value super-block) quantize x
 * as llama.cpp's block_q8_K: one float32 scale per super-block of 256, the values rounded as above, and
 * their sums per 16. A super-block then stays in int32 to its end: per sub-block the exact dot product
 * times the sub-block's integer scale (AVX2: the int16 pair sums widened by a madd with the scale), added
 * up; Q4_K and Q5_K's minimums as sum(m * sum(x)), Q6_K's offset of 32 as 32 * sum(sc * sum(x)), both by
 * int16 pairs. Only then float32, once per super-block and row: + dot * (d * d_x), and for Q4_K and
 * Q5_K - mins * (dmin * d_x) (kquant.reference_matmul, bit for bit). Per block of 32 that float step
 * (and its scales' broadcasts) cost more than the block's products, and a K-quant weight byte more than
 * a Q4_0 one. Q5_K's fifth bits and Q6_K's high pairs are shifted into the nibbles in registers (16-bit
 * shifts whose bits from the neighbouring byte the masks drop). On AVX2, from TL_MIN_ROWS rows, the types of
 * unsigned values (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) put 8 tokens in the lanes instead of 8 weight rows
 * (tl_group, below): the same sums, bit for bit.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "quant_layout.h"

#define PF_ROWS 4                    /* Q5_K/Q6_K tiles of up to this many rows prefetch whole super-blocks */
#define MAX_CHUNK_BYTES (512L << 10) /* int8 rows of x per pass over the weights: within L2 */

#ifdef __AVX512F__
#define MR_MAX 8
#define HALVES 1                    /* 16 lanes of int32 per vector: a whole group */
#define WIDTH 512
typedef __m512i vi;
typedef __m512 vf;
#define LOADI(p) _mm512_loadu_si512((const void *)(p))
#define SET1I _mm512_set1_epi32
#define SET1B _mm512_set1_epi8
#define ANDI _mm512_and_si512
#define SRLI16 _mm512_srli_epi16
#define CVT _mm512_cvtepi32_ps
#define VADD _mm512_add_ps
#define VMUL _mm512_mul_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VSTORE _mm512_storeu_ps
#define LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOAD_U8_I32(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD_I8_I32(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define MULLO _mm512_mullo_epi32
#define ADDI _mm512_add_epi32
#define SUBI _mm512_sub_epi32
#define ORI _mm512_or_si512
#define SLLI16 _mm512_slli_epi16
#define SRLI32 _mm512_srli_epi32
#define SLLI32 _mm512_slli_epi32
#define SRL16(v, n) _mm512_srl_epi16(v, _mm_cvtsi32_si128(n))
#define VSUB _mm512_sub_ps
#define SHUF8 _mm512_shuffle_epi8                         /* a byte table per 128 bits, indexed by low nibbles */
#define TABLE16(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p)))
#ifdef __AVX512VNNI__
#define DOT_U8(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define DOT_I16(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)   /* int16 pairs: a0 b0 + a1 b1 per lane */
/* Q8_0 bytes made unsigned (w + 128): the +128 comes back as -128 * sum(x) in the start value. */
#define Q8_BIAS 128
#define Q8_PREP(w) _mm512_xor_si512(w, SET1B((char)0x80))
#define DOT_S8(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#else
static inline vi dot_u8(vi acc, vi w, vi x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
#define DOT_U8 dot_u8
#define DOT_I16(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#define Q8_BIAS 0
#define Q8_PREP(w) (w)
/* |w| times x with w's sign: pairs stay within int16 (2 * 128 * 127). */
static inline vi dot_s8(vi acc, vi w, vi x) {
    vi sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    return dot_u8(acc, _mm512_abs_epi8(w), sx);
}
#define DOT_S8 dot_s8
#endif
#else
#define MR_MAX 4
#define HALVES 2                    /* 8 lanes per vector: two halves of a group */
#define WIDTH 256
typedef __m256i vi;
typedef __m256 vf;
#define LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define SET1I _mm256_set1_epi32
#define SET1B _mm256_set1_epi8
#define ANDI _mm256_and_si256
#define SRLI16 _mm256_srli_epi16
#define CVT _mm256_cvtepi32_ps
#define VADD _mm256_add_ps
#define VMUL _mm256_mul_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VSTORE _mm256_storeu_ps
#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD_U8_I32(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define LOAD_I8_I32(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define MULLO _mm256_mullo_epi32
#define ADDI _mm256_add_epi32
#define SUBI _mm256_sub_epi32
#define ORI _mm256_or_si256
#define SLLI16 _mm256_slli_epi16
#define SRLI32 _mm256_srli_epi32
#define SLLI32 _mm256_slli_epi32
#define SRL16(v, n) _mm256_srl_epi16(v, _mm_cvtsi32_si128(n))
#define VSUB _mm256_sub_ps
#define SHUF8 _mm256_shuffle_epi8
#define TABLE16(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
static inline vi dot_u8(vi acc, vi w, vi x) {   /* Q4 pairs: 2 * 15 * 127, within int16 */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
#define DOT_U8 dot_u8
/* Without VNNI a dot product is maddubs (u8 x s8 pairs summed to int16), then madd to int32: the Q4 and Q5
 * blocks sum several pair vectors in int16 first (exact while they fit) and widen once. */
#define PAIRS16 _mm256_maddubs_epi16
#define ADD16 _mm256_add_epi16
#define WIDEN_PAIRS(acc, p) _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
/* The K-quants widen their int16 pair sums by a madd with the sub-block's scale in both halves of a lane:
 * the widening and the scale's multiply in one instruction. */
#define MADD16 _mm256_madd_epi16
#define DOT_I16(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define Q8_BIAS 0
#define Q8_PREP(w) (w)
static inline vi dot_s8(vi acc, vi w, vi x) {
    return dot_u8(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
#define DOT_S8 dot_s8
#endif
#define LANES (GR / HALVES)
/* The K-quant kernels keep five vectors a row (two sub-blocks' sums, the super-block's dot product and minimums,
 * the float32 result): at 8 rows 40, more than AVX-512's 32 registers. At 6 rows they fit, and a Zen 4 core ran
 * 64-row Q4_K 1.07x and Q6_K 1.14x as fast as at 8 (one 512 x 2048 weight in L2). */
#define MR_K (MR_MAX < 6 ? MR_MAX : 6)
/* A product kept apart from the sum it enters: no fused multiply-add, so every output is the float32
 * sequence quant_linear.reference_matmul computes, bit for bit. */
#define KEEP(v) __asm__("" : "+v"(v))
#define KEEP_S(f) __asm__("" : "+x"(f))   /* the same for a float */

/* IQ4's 16 levels as the weight bytes DOT_S8 takes, after Q8_PREP (on VNNI + 128, unsigned; on AVX2 signed, their
 * magnitudes meeting x with their signs), in every 128 bits: a SHUF8 by nibbles gives a column's levels. */
static const int8_t IQ4_TABLE[16] = IQ4_LEVELS;

static inline vi iq4_table(void) { return Q8_PREP(TABLE16(IQ4_TABLE)); }

/* The sums of a's 8 lanes and of b's. */
static inline void sum2(__m256i a, __m256i b, int32_t *sa, int32_t *sb) {
    __m256i p = _mm256_hadd_epi32(a, b);   /* a01 a23 b01 b23 | a45 a67 b45 b67 */
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    s = _mm_hadd_epi32(s, s);
    *sa = _mm_cvtsi128_si32(s);
    *sb = _mm_extract_epi32(s, 1);
}

/* An int32 lane's low byte, sign-extended: the (int8_t) it is stored as. */
#define LOW_I8(v, w) _mm##w##_srai_epi32(_mm##w##_slli_epi32(v, 24), 24)
/* 8 or 16 bf16 to float32: their bits in the high half. */
#define WIDEN8(p) bf16x8_to_f32(_mm_loadu_si128((const __m128i *)(p)))
#define WIDEN16(p) bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(p)))

/* 32 values of x widened to float32: 4 vectors of 8 (on AVX-512 loaded as 2 of 16). */
typedef struct {
#ifdef __AVX512F__
    __m512 w[2];
#endif
    __m256 v[4];
} block32;

static inline block32 load_block(const void *x, int x_bf16, long at) {
    const uint16_t *xh = (const uint16_t *)x + at;
    const float *xf = (const float *)x + at;
    block32 b;
#ifdef __AVX512F__
    for (int j = 0; j < 2; j++) b.w[j] = x_bf16 ? WIDEN16(xh + 16 * j) : _mm512_loadu_ps(xf + 16 * j);
    for (int j = 0; j < 4; j++)
        b.v[j] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b.w[j / 2]), j & 1));
#else
    for (int j = 0; j < 4; j++) b.v[j] = x_bf16 ? WIDEN8(xh + 8 * j) : _mm256_loadu_ps(xf + 8 * j);
#endif
    return b;
}

/* The block's largest |x|, over its 4 vectors of 8 in one order on both widths (x86's max keeps its second
 * operand for a NaN). */
static inline __m128 block_amax(const block32 *b) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, b->v[j]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
}

/* The block times inv, rounded to nearest even, into q's 32 int8 (each value truncated to its low byte, as
 * (int8_t) does); *total and *first get the sums of all 32 and of the first 16. */
static inline void round_block(const block32 *b, float inv, int8_t *q, int32_t *total, int32_t *first) {
    __m256i t, f;
#ifdef __AVX512F__
    __m512i r0 = _mm512_cvtps_epi32(_mm512_mul_ps(b->w[0], _mm512_set1_ps(inv)));   /* nearest even */
    __m512i r1 = _mm512_cvtps_epi32(_mm512_mul_ps(b->w[1], _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(r0));   /* vpmovdb: the low bytes */
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(r1));
    __m512i s = _mm512_add_epi32(r0, r1), h = LOW_I8(r0, 512);
    t = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    f = _mm256_add_epi32(_mm512_castsi512_si256(h), _mm512_extracti64x4_epi64(h, 1));
#else
    __m256i r[4];
    for (int j = 0; j < 4; j++) r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(b->v[j], _mm256_set1_ps(inv)));
    /* Low bytes (0..255) packed without saturating; the packs interleave 4-byte groups of the 128-bit halves. */
    __m256i lo[4];
    for (int j = 0; j < 4; j++) lo[j] = _mm256_and_si256(r[j], _mm256_set1_epi32(0xff));
    __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(lo[0], lo[1]), _mm256_packus_epi32(lo[2], lo[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    t = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    f = _mm256_add_epi32(LOW_I8(r[0], 256), LOW_I8(r[1], 256));
#endif
    sum2(t, f, total, first);
}

/* One row of x (float32 or bf16) -> int8 values, a float32 scale (amax / 127) and the sum of the values
 * per block of 32. Any x, NaN included, quantizes as the scalar loop did. */
static void quantize_row(const void *x, int x_bf16, long K, int8_t *q, float *d, int32_t *sum) {
    for (long b = 0; b < K / QK; b++) {
        const block32 blk = load_block(x, x_bf16, b * QK);
        float scale = _mm_cvtss_f32(block_amax(&blk)) / 127.0f;
        float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        int32_t first;
        d[b] = scale;
        round_block(&blk, inv, q + b * QK, sum + b, &first);
    }
}

/* The K-quants' x, llama.cpp's block_q8_K: one float32 scale per super-block of 256 (amax / 127, the
 * blocks' maxima taken in order), the values rounded as quantize_row rounds them, and the sum of each 16
 * (sums16[16 s + t]: values 16 t.. of super-block s) for the minimums and Q6_K's offset. */
static void quantize_row_k(const void *x, int x_bf16, long K, int8_t *q, float *d, int32_t *sums16) {
    for (long s = 0; s < K / QKK; s++) {
        block32 blk[QKK / QK];
        __m128 amax = _mm_setzero_ps();
        for (int j = 0; j < QKK / QK; j++) {
            blk[j] = load_block(x, x_bf16, s * QKK + j * QK);
            amax = _mm_max_ss(amax, block_amax(&blk[j]));
        }
        float scale = _mm_cvtss_f32(amax) / 127.0f;
        float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        d[s] = scale;
        for (int j = 0; j < QKK / QK; j++) {
            int32_t *at = sums16 + s * 16 + 2 * j, total;
            round_block(&blk[j], inv, q + s * QKK + j * QK, &total, at);
            at[1] = total - at[0];
        }
    }
}

/* Step `it` of a K-quant super-block's 32 (a column of 4-byte lanes each) prefetches the next super-block's line of
 * its own (at_step + gb), or with `whole` lines 2 it and 2 it + 1 of the super-block two ahead, so its scales and
 * high bits come too. Whole for Q5_K and Q6_K (two streams a super-block) at tiles of up to PF_ROWS rows, where
 * the step waits for memory: from PF_ROWS + 1 rows on, a group is read from memory by its first tile and from L2
 * by every later one, whose extra prefetches would only take load slots. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *blk, const uint8_t *at_step, long gb,
                                                                  int whole, int it) {
    if (!whole) {
        _mm_prefetch((const char *)(at_step + gb), _MM_HINT_T0);
        return;
    }
    const long at = it * 128;
    if (at < gb) _mm_prefetch((const char *)(blk + 2 * gb + at), _MM_HINT_T0);
    if (at + 64 < gb) _mm_prefetch((const char *)(blk + 2 * gb + at + 64), _MM_HINT_T0);
}

static inline int32_t bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* A 32-value block's vector of 4-byte columns c (raw: low nibbles values 4c.., high 16 + 4c..) as its values lo and
 * hi; for Q5 (q5) each column's fifth bits from *qh (bit j of a row's uint32: value j's; bits 4c.. and 16 + 4c..
 * in its low 4 and 16 bits by now) go to bit 4 of its bytes by one multiply, and *qh moves on to column c + 1. */
static inline __attribute__((always_inline)) void q45_values(int q5, vi raw, vi *qh, vi *lo, vi *hi) {
    const vi low = SET1B(0x0f);
    *lo = ANDI(raw, low), *hi = ANDI(SRLI16(raw, 4), low);
    if (q5) {
        const vi nib = SET1I(15), spread = SET1I(0x02040810), bit4 = SET1B(0x10);
        *lo = ORI(*lo, ANDI(MULLO(ANDI(*qh, nib), spread), bit4));
        *hi = ORI(*hi, ANDI(MULLO(ANDI(SRLI32(*qh, 16), nib), spread), bit4));
        *qh = SRLI32(*qh, 4);
    }
}

/* MR rows of quantized x times NH halves of one group (all K/32 blocks), from half h -> tile[MR][GR] at lanes
 * (h + u) * LANES. On AVX2 (two halves of 8 lanes) NH = 2 reads a group's stream once with all its work on it,
 * where two passes of one half read it from memory in the first and from cache in the second: the first pass's
 * wait for memory then overlaps only half the work (a lone row's Q4_0 0.78 of the read rate on a Zen 3). */
static inline __attribute__((always_inline)) void kernel(const int type, const int MR, const int NH,
                                                         const uint8_t *w, long nb, const int8_t *xq,
                                                         const float *xd, const int32_t *xo, const float *xm,
                                                         long K, int h, float *tile) {
    const long gb = group_bytes(type);
    const long head = type == Q4_1 || type == Q5_1 ? 4 * GR : 2 * GR;
    const int q5 = type == Q5_0 || type == Q5_1;
    vf facc[MR_MAX * HALVES];   /* [i * NH + u]: row i, half h + u */
    for (int i = 0; i < MR * NH; i++) facc[i] = VZERO();
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * gb;
#ifdef __AVX512F__
        _mm_prefetch((const char *)(blk + 4 * gb), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + 4 * gb + 64), _MM_HINT_T0);
#else   /* every line of the block 4 ahead, on the first half's pass: 0.82-0.86x the time at 1-4 rows on a Zen 3 */
        if (h == 0)
            for (long at = 0; at < gb; at += 64) _mm_prefetch((const char *)(blk + 4 * gb + at), _MM_HINT_T0);
#endif
        const uint8_t *qs = blk + head + h * LANES * 4;
        vi acc[MR_MAX * HALVES];
        for (int i = 0; i < MR; i++)
            for (int u = 0; u < NH; u++)
                acc[i * NH + u] = type == Q4_1 || type == Q5_1 ? SET1I(0) : SET1I(xo[i * nb + b]);
        const int8_t *xb = xq + b * QK;
        if (type == Q8_0) {
            for (int v = 0; v < 8; v++) {
                vi wv[HALVES];
                for (int u = 0; u < NH; u++) wv[u] = Q8_PREP(LOADI(qs + v * GR * 4 + u * LANES * 4));
                for (int i = 0; i < MR; i++) {
                    const vi xv = SET1I(bcast4(xb + i * K + 4 * v));
                    for (int u = 0; u < NH; u++) acc[i * NH + u] = DOT_S8(acc[i * NH + u], wv[u], xv);
                }
            }
        } else {
#ifdef PAIRS16
            vi pairs[MR_MAX * HALVES];
            for (int i = 0; i < MR * NH; i++) pairs[i] = SET1I(0);
#endif
            const vi table = iq4_table();
            vi qh[HALVES];
            for (int u = 0; u < NH; u++) qh[u] = q5 ? LOADI(qs + u * LANES * 4) : SET1I(0);
            const uint8_t *nibbles = q5 ? qs + GR * 4 : qs;
            for (int c = 0; c < 4; c++) {
                vi lo[HALVES], hi[HALVES];
                for (int u = 0; u < NH; u++) {
                    q45_values(q5, LOADI(nibbles + c * GR * 4 + u * LANES * 4), &qh[u], &lo[u], &hi[u]);
                    if (type == IQ4_NL) lo[u] = SHUF8(table, lo[u]), hi[u] = SHUF8(table, hi[u]);
                }
                for (int i = 0; i < MR; i++) {
                    const vi x0 = SET1I(bcast4(xb + i * K + 4 * c)), x1 = SET1I(bcast4(xb + i * K + 16 + 4 * c));
                    for (int u = 0; u < NH; u++) {
                        if (type == IQ4_NL) {   /* signed levels: an AVX2 pair sum reaches 2 * 127 * 127 alone */
                            acc[i * NH + u] = DOT_S8(acc[i * NH + u], lo[u], x0);
                            acc[i * NH + u] = DOT_S8(acc[i * NH + u], hi[u], x1);
                            continue;
                        }
#ifdef PAIRS16
                        pairs[i * NH + u] = ADD16(pairs[i * NH + u], ADD16(PAIRS16(lo[u], x0), PAIRS16(hi[u], x1)));
#else
                        acc[i * NH + u] = DOT_U8(acc[i * NH + u], lo[u], x0);
                        acc[i * NH + u] = DOT_U8(acc[i * NH + u], hi[u], x1);
#endif
                    }
                }
#ifdef PAIRS16
                if (type != IQ4_NL && (!q5 || c & 1))   /* Q4: 8 sums of 2 * 15 * 127 fit int16; Q5: 4 do */
                    for (int i = 0; i < MR * NH; i++) acc[i] = WIDEN_PAIRS(acc[i], pairs[i]), pairs[i] = SET1I(0);
#endif
            }
        }
        for (int u = 0; u < NH; u++) {
            vf dw = LOAD_F16(blk + (h + u) * LANES * 2);
            for (int i = 0; i < MR; i++) {
                vf t = VMUL(CVT(acc[i * NH + u]), VMUL(dw, VSET1(xd[i * nb + b])));
                KEEP(t);
                facc[i * NH + u] = VADD(facc[i * NH + u], t);
            }
            if (type == Q4_1 || type == Q5_1) {
                vf mw = LOAD_F16(blk + 2 * GR + (h + u) * LANES * 2);
                for (int i = 0; i < MR; i++) {
                    vf t = VMUL(mw, VSET1(xm[i * nb + b]));
                    KEEP(t);
                    facc[i * NH + u] = VADD(facc[i * NH + u], t);
                }
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int u = 0; u < NH; u++) VSTORE(tile + i * GR + (h + u) * LANES, facc[i * NH + u]);
}

/* The K-quants' integer scales of 16 rows (bytes at p, one per row) as lanes: on AVX2 in both int16 halves of a
 * lane, for a madd with int16 pair sums; else an int32 for a mullo. */
static inline vi scale_u8(const uint8_t *p) {
    vi v = LOAD_U8_I32(p);
#ifdef MADD16
    v = ORI(v, SLLI32(v, 16));
#endif
    return v;
}

static inline vi scale_i8(const uint8_t *p) {
    vi v = LOAD_I8_I32(p);
#ifdef MADD16
    v = ORI(ANDI(v, SET1I(0xffff)), SLLI32(v, 16));
#endif
    return v;
}

/* Two bytes per row (at a and b, unsigned or signed) as the int16 halves of the rows' lanes: a DOT_I16 operand. */
static inline vi pair_u8(const uint8_t *a, const uint8_t *b) { return ORI(LOAD_U8_I32(a), SLLI32(LOAD_U8_I32(b), 16)); }

static inline vi pair_i8(const uint8_t *a, const uint8_t *b) {
    return ORI(ANDI(LOAD_I8_I32(a), SET1I(0xffff)), SLLI32(LOAD_I8_I32(b), 16));
}

/* One super-block's integer sums of MR rows into the float32 accumulators of half u (at [i * NH + u]): facc +=
 * dot * (d_w * d_x), then for Q4_K and Q5_K facc -= mins * (dmin_w * d_x), one product and one add each per
 * super-block, in the order kquant.reference_matmul adds them. */
static inline __attribute__((always_inline)) void scale_super(const int MR, const int NH, int u, vf *facc,
                                                              const vi *dot, const vi *mins, vf dw, vf mw,
                                                              const float *xd, long ns) {
    for (int i = 0; i < MR; i++) {
        const vf dx = VSET1(xd[i * ns]);
        vf t = VMUL(CVT(dot[i * NH + u]), VMUL(dw, dx));
        KEEP(t);
        facc[i * NH + u] = VADD(facc[i * NH + u], t);
        if (mins) {
            vf v = VMUL(CVT(mins[i * NH + u]), VMUL(mw, dx));
            KEEP(v);
            facc[i * NH + u] = VSUB(facc[i * NH + u], v);
        }
    }
}

/* A Q4_K or Q5_K vector of 4-byte columns (raw) as the values of sub-blocks 2p (lo) and 2p + 1 (hi); Q5_K's fifth
 * bits from its column of high bits (qh: bits 2p, 2p + 1 of each byte). */
static inline __attribute__((always_inline)) void k45_values(const int type, vi raw, const uint8_t *qh, int p, vi *lo,
                                                             vi *hi) {
    const vi low = SET1B(0x0f), bit4 = SET1B(0x10);
    *lo = ANDI(raw, low), *hi = ANDI(SRLI16(raw, 4), low);
    if (type == Q5_K) {
        const vi hb = SRL16(LOADI(qh), 2 * p);   /* bits 2p, 2p+1 to 0, 1 */
        *lo = ORI(*lo, ANDI(SLLI16(hb, 4), bit4)), *hi = ORI(*hi, ANDI(SLLI16(hb, 3), bit4));
    }
}

/* A Q6_K vector of column c's nibbles (nib) and its high pairs (hb) as 6-bit values: low nibbles (lo), high (hi). */
static inline __attribute__((always_inline)) void q6k_values(vi nib, vi hb, int c, vi *lo, vi *hi) {
    const vi low = SET1B(0x0f), pair = SET1B(0x30);
    *lo = ANDI(nib, low), *hi = ANDI(SRLI16(nib, 4), low);
    if (c & 1) {
        *lo = ORI(*lo, ANDI(hb, pair)), *hi = ORI(*hi, ANDI(SRLI16(hb, 2), pair));
    } else {
        *lo = ORI(*lo, ANDI(SLLI16(hb, 4), pair)), *hi = ORI(*hi, ANDI(SLLI16(hb, 2), pair));
    }
}

/* Q4_K and Q5_K: MR rows of x times NH halves (from h) of one group's ns super-blocks. A super-block is 4 pairs
 * of sub-blocks of 32; byte k of a row's 4-byte column c of pair p holds sub-block 2p's value 4c + k in its
 * low nibble and 2p + 1's in its high one, and the fifth bits of both in bits 2p and 2p + 1 of the Q5_K
 * column c. Per sub-block j the exact int32 dot product times sc[j] is added up over the whole super-block
 * in int32 (|sum| <= 8 * 63 * 32 * 31 * 127 < 2^26: Q4_K's values are <= 15, Q5_K's <= 31, the scales
 * 6 bits), and the minimums' sum of m[j] * sum(x of j) (<= 8 * 63 * 32 * 127) by int16 pairs: xp holds
 * per row and super-block 4 int32s, the x sums of sub-blocks 2t and 2t + 1 as their low and high halves. */
static inline __attribute__((always_inline)) void kernel_k45(const int type, const int MR, const int NH,
                                                             const uint8_t *w, long ns, const int8_t *xq,
                                                             const float *xd, const int32_t *xp, long K, int h,
                                                             float *tile) {
    const long gb = group_bytes(type);
    vf facc[MR_MAX * HALVES];   /* [i * NH + u]: row i, half h + u */
    for (int i = 0; i < MR * NH; i++) facc[i] = VZERO();
    for (long s = 0; s < ns; s++) {
        const uint8_t *blk = w + s * gb;
        const uint8_t *scp = blk + 4 * GR + h * LANES, *mnp = blk + 12 * GR + h * LANES;
        const uint8_t *qs = blk + 20 * GR + h * LANES * 4, *qh = qs + 128 * GR;
        vi dot[MR_MAX * HALVES], mins[MR_MAX * HALVES];
        for (int i = 0; i < MR * NH; i++) dot[i] = mins[i] = SET1I(0);
        for (int p = 0; p < 4; p++) {
            const int8_t *x0 = xq + s * QKK + 2 * p * QK, *x1 = x0 + QK;
            vi sc0[HALVES], sc1[HALVES];
            for (int u = 0; u < NH; u++)
                sc0[u] = scale_u8(scp + 2 * p * GR + u * LANES), sc1[u] = scale_u8(scp + (2 * p + 1) * GR + u * LANES);
            /* AVX2: int16 pair sums, 8 of 2 * 15 * 127 (Q5_K: 4 of 2 * 31 * 127) */
            vi acc0[MR_MAX * HALVES], acc1[MR_MAX * HALVES];
            for (int i = 0; i < MR * NH; i++) acc0[i] = acc1[i] = SET1I(0);
            for (int c = 0; c < 8; c++) {
                vi lo[HALVES], hi[HALVES];
                for (int u = 0; u < NH; u++) {
                    const uint8_t *at = qs + (p * 8 + c) * GR * 4 + u * LANES * 4;
                    /* Q5_K's fifth bits too; Q4_K's whole super-block was no faster than its nibbles' lines */
                    if (u == 0) prefetch_ahead(blk, at, gb, type == Q5_K && MR <= PF_ROWS, p * 8 + c);
                    k45_values(type, LOADI(at), qh + c * GR * 4 + u * LANES * 4, p, &lo[u], &hi[u]);
                }
                for (int i = 0; i < MR; i++) {
                    const vi xa = SET1I(bcast4(x0 + i * K + 4 * c)), xb = SET1I(bcast4(x1 + i * K + 4 * c));
                    for (int u = 0; u < NH; u++) {
#ifdef MADD16
                        acc0[i * NH + u] = ADD16(acc0[i * NH + u], PAIRS16(lo[u], xa));
                        acc1[i * NH + u] = ADD16(acc1[i * NH + u], PAIRS16(hi[u], xb));
#else
                        acc0[i * NH + u] = DOT_U8(acc0[i * NH + u], lo[u], xa);
                        acc1[i * NH + u] = DOT_U8(acc1[i * NH + u], hi[u], xb);
#endif
                    }
                }
#ifdef MADD16
                if (c == 7 || (type == Q5_K && c == 3))
                    for (int i = 0; i < MR * NH; i++) {
                        dot[i] = ADDI(dot[i], ADDI(MADD16(acc0[i], sc0[i % NH]), MADD16(acc1[i], sc1[i % NH])));
                        acc0[i] = acc1[i] = SET1I(0);
                    }
#endif
            }
#ifndef MADD16
            for (int i = 0; i < MR * NH; i++)
                dot[i] = ADDI(dot[i], ADDI(MULLO(acc0[i], sc0[i % NH]), MULLO(acc1[i], sc1[i % NH])));
#endif
        }
        for (int t = 0; t < 4; t++)
            for (int u = 0; u < NH; u++) {
                const vi m = pair_u8(mnp + 2 * t * GR + u * LANES, mnp + (2 * t + 1) * GR + u * LANES);
                for (int i = 0; i < MR; i++)
                    mins[i * NH + u] = DOT_I16(mins[i * NH + u], m, SET1I(xp[i * ns * 4 + s * 4 + t]));
            }
        for (int u = 0; u < NH; u++)
            scale_super(MR, NH, u, facc, dot, mins, LOAD_F16(blk + (h + u) * LANES * 2),
                        LOAD_F16(blk + 2 * GR + (h + u) * LANES * 2), xd + s, ns);
    }
    for (int i = 0; i < MR; i++)
        for (int u = 0; u < NH; u++) VSTORE(tile + i * GR + (h + u) * LANES, facc[i * NH + u]);
}

/* dot -= 2^shift * sum(sc[s] * sum(x of s)) over a super-block's signed scales (int8 at scp, GR a scale), by int16
 * pairs: xp holds per row (a row every `stride` int32s) `pairs` int32s, the x sums of scales 2t and 2t + 1 as their
 * halves. An offset of the values, taken off once per super-block: Q6_K's 32 (2^5), IQ4_XS's 128 on VNNI (2^7). */
static inline __attribute__((always_inline)) void less_offset(const int MR, const int NH, vi *dot, const uint8_t *scp,
                                                              const int32_t *xp, long stride, int pairs, int shift) {
    vi offset[MR_MAX * HALVES];
    for (int i = 0; i < MR * NH; i++) offset[i] = SET1I(0);
    for (int t = 0; t < pairs; t++)
        for (int u = 0; u < NH; u++) {
            const vi sc = pair_i8(scp + 2 * t * GR + u * LANES, scp + (2 * t + 1) * GR + u * LANES);
            for (int i = 0; i < MR; i++)
                offset[i * NH + u] = DOT_I16(offset[i * NH + u], sc, SET1I(xp[i * stride + t]));
        }
    for (int i = 0; i < MR * NH; i++) dot[i] = SUBI(dot[i], SLLI32(offset[i], shift));
}

/* Q6_K: per 32 values b of a super-block, 4 columns of nibbles (low: value 4c + k, high: 16 + 4c + k) and 2 of
 * high pairs (bits 0-1, 2-3, 4-5, 6-7: columns 2i's low and high value, then 2i + 1's). The values are
 * multiplied unsigned (0..63) and each 16's product by its scale, added up over the super-block in int32;
 * the offset of 32 comes off once per super-block as 32 * sum(sc[s] * sum(x of s)) by int16 pairs (xp: per
 * row and super-block 8 int32s, the x sums of 16s 2t and 2t + 1 as their halves). What is left,
 * sum(sc[s] * sum((q - 32) x)), is within 16 * 128 * 16 * 32 * 127 < 2^28; the unsigned part and the offset
 * within 2^29 each: int32 holds them all. NH halves from h, as kernel_k45. */
static inline __attribute__((always_inline)) void kernel_q6k(const int MR, const int NH, const uint8_t *w, long ns,
                                                             const int8_t *xq, const float *xd, const int32_t *xp,
                                                             long K, int h, float *tile) {
    const long gb = group_bytes(Q6_K);
    vf facc[MR_MAX * HALVES];
    for (int i = 0; i < MR * NH; i++) facc[i] = VZERO();
    for (long s = 0; s < ns; s++) {
        const uint8_t *blk = w + s * gb;
        const uint8_t *scp = blk + 2 * GR + h * LANES, *ql = blk + 18 * GR + h * LANES * 4, *qhp = ql + 128 * GR;
        vi dot[MR_MAX * HALVES];
        for (int i = 0; i < MR * NH; i++) dot[i] = SET1I(0);
        for (int j = 0; j < 8; j++) {
            const int8_t *xb = xq + s * QKK + j * QK;
            vi s0[HALVES], s1[HALVES];
            for (int u = 0; u < NH; u++)
                s0[u] = scale_i8(scp + 2 * j * GR + u * LANES), s1[u] = scale_i8(scp + (2 * j + 1) * GR + u * LANES);
            vi acc0[MR_MAX * HALVES], acc1[MR_MAX * HALVES];   /* AVX2: int16 pair sums, 2 of 2 * 63 * 127 */
            for (int i = 0; i < MR * NH; i++) acc0[i] = acc1[i] = SET1I(0);
            for (int c = 0; c < 4; c++) {
                vi lo[HALVES], hi[HALVES];
                for (int u = 0; u < NH; u++) {
                    const uint8_t *at = ql + (j * 4 + c) * GR * 4 + u * LANES * 4;
                    if (u == 0) prefetch_ahead(blk, at, gb, MR <= PF_ROWS, j * 4 + c);
                    q6k_values(LOADI(at), LOADI(qhp + (j * 2 + c / 2) * GR * 4 + u * LANES * 4), c, &lo[u], &hi[u]);
                }
                for (int i = 0; i < MR; i++) {
                    const vi xa = SET1I(bcast4(xb + i * K + 4 * c)), xc = SET1I(bcast4(xb + i * K + 16 + 4 * c));
                    for (int u = 0; u < NH; u++) {
#ifdef MADD16
                        acc0[i * NH + u] = ADD16(acc0[i * NH + u], PAIRS16(lo[u], xa));
                        acc1[i * NH + u] = ADD16(acc1[i * NH + u], PAIRS16(hi[u], xc));
#else
                        acc0[i * NH + u] = DOT_U8(acc0[i * NH + u], lo[u], xa);
                        acc1[i * NH + u] = DOT_U8(acc1[i * NH + u], hi[u], xc);
#endif
                    }
                }
#ifdef MADD16
                if (c & 1)
                    for (int i = 0; i < MR * NH; i++) {
                        dot[i] = ADDI(dot[i], ADDI(MADD16(acc0[i], s0[i % NH]), MADD16(acc1[i], s1[i % NH])));
                        acc0[i] = acc1[i] = SET1I(0);
                    }
#endif
            }
#ifndef MADD16
            for (int i = 0; i < MR * NH; i++)
                dot[i] = ADDI(dot[i], ADDI(MULLO(acc0[i], s0[i % NH]), MULLO(acc1[i], s1[i % NH])));
#endif
        }
        less_offset(MR, NH, dot, scp, xp + s * 8, ns * 8, 8, 5);
        for (int u = 0; u < NH; u++)
            scale_super(MR, NH, u, facc, dot, 0, LOAD_F16(blk + (h + u) * LANES * 2), VZERO(), xd + s, ns);
    }
    for (int i = 0; i < MR; i++)
        for (int u = 0; u < NH; u++) VSTORE(tile + i * GR + (h + u) * LANES, facc[i * NH + u]);
}

/* IQ4_XS: per sub-block j of 32 values, 4 columns of nibbles (low: value 4c + k, high: 16 + 4c + k), each an index
 * into IQ4's 16 signed levels (SHUF8), one signed scale (the file's 6 bits less 32) per sub-block. Each sub-block's
 * exact dot product times its scale is added up over the super-block in int32. On VNNI the levels are multiplied
 * + 128 (unsigned) and 128 * sum(sc * sum(x of j)) comes off once per super-block by int16 pairs, as Q6_K's offset
 * (|each part| <= 8 * 32 * 32 * 241 * 127 < 2^28); on AVX2 a level's magnitude meets x with the level's sign, and
 * each column's int16 pair sums are widened by a madd with the scale. NH halves from h, as kernel_k45. */
static inline __attribute__((always_inline)) void kernel_iq4xs(const int MR, const int NH, const uint8_t *w, long ns,
                                                               const int8_t *xq, const float *xd, const int32_t *xp,
                                                               long K, int h, float *tile) {
    const long gb = group_bytes(IQ4_XS);
    const vi low = SET1B(0x0f), table = iq4_table();
    vf facc[MR_MAX * HALVES];
    for (int i = 0; i < MR * NH; i++) facc[i] = VZERO();
    for (long s = 0; s < ns; s++) {
        const uint8_t *blk = w + s * gb;
        const uint8_t *scp = blk + 2 * GR + h * LANES, *qs = blk + 10 * GR + h * LANES * 4;
        vi dot[MR_MAX * HALVES];
        for (int i = 0; i < MR * NH; i++) dot[i] = SET1I(0);
        for (int j = 0; j < 8; j++) {
            const int8_t *xb = xq + s * QKK + j * QK;
            vi sc[HALVES];
            for (int u = 0; u < NH; u++) sc[u] = scale_i8(scp + j * GR + u * LANES);
#ifndef MADD16
            vi acc[MR_MAX * HALVES];
            for (int i = 0; i < MR * NH; i++) acc[i] = SET1I(0);
#endif
            for (int c = 0; c < 4; c++) {
                vi lo[HALVES], hi[HALVES];
                for (int u = 0; u < NH; u++) {
                    const uint8_t *at = qs + (j * 4 + c) * GR * 4 + u * LANES * 4;
                    if (u == 0) prefetch_ahead(blk, at, gb, 0, j * 4 + c);   /* one stream, as Q4_K */
                    const vi raw = LOADI(at);
                    lo[u] = SHUF8(table, ANDI(raw, low)), hi[u] = SHUF8(table, ANDI(SRLI16(raw, 4), low));
                }
                for (int i = 0; i < MR; i++) {
                    const vi xa = SET1I(bcast4(xb + i * K + 4 * c)), xc = SET1I(bcast4(xb + i * K + 16 + 4 * c));
                    for (int u = 0; u < NH; u++) {
#ifdef MADD16   /* |level| x (x with the level's sign): pair sums within 2 * 127 * 127 */
                        const vi pl = PAIRS16(_mm256_abs_epi8(lo[u]), _mm256_sign_epi8(xa, lo[u]));
                        const vi ph = PAIRS16(_mm256_abs_epi8(hi[u]), _mm256_sign_epi8(xc, hi[u]));
                        dot[i * NH + u] = ADDI(dot[i * NH + u], ADDI(MADD16(pl, sc[u]), MADD16(ph, sc[u])));
#else
                        acc[i * NH + u] = DOT_S8(acc[i * NH + u], lo[u], xa);
                        acc[i * NH + u] = DOT_S8(acc[i * NH + u], hi[u], xc);
#endif
                    }
                }
            }
#ifndef MADD16
            for (int i = 0; i < MR * NH; i++) dot[i] = ADDI(dot[i], MULLO(acc[i], sc[i % NH]));
#endif
        }
        if (Q8_BIAS) less_offset(MR, NH, dot, scp, xp + s * 4, ns * 4, 4, 7);   /* 128 = 2^7 */
        for (int u = 0; u < NH; u++)
            scale_super(MR, NH, u, facc, dot, 0, LOAD_F16(blk + (h + u) * LANES * 2), VZERO(), xd + s, ns);
    }
    for (int i = 0; i < MR; i++)
        for (int u = 0; u < NH; u++) VSTORE(tile + i * GR + (h + u) * LANES, facc[i * NH + u]);
}

typedef void (*kernel_fn)(const uint8_t *, long, const int8_t *, const float *, const int32_t *, const float *, long,
                          float *);

/* A tile takes a group's halves in one pass (NH = HALVES) where its registers hold both halves' sums: every tile
 * but Q4_K's of 4 rows (16 int16 and int32 sums, besides the values). Measured on a Zen 3, both halves in one
 * pass against one a pass (1.07B shape's projections from memory, 2 threads): 1 row Q4_K 0.77x the time, Q4_0
 * 0.76x, Q6_K 0.81x, Q5_K 0.78x; 4 rows Q8_0 0.76x, Q5_K 0.77x, Q6_K 0.91x, Q4_0 0.93x; 64 rows Q8_0 0.87x, the
 * others within 3%; Q4_K at 4 rows 1.10x (so not fused there). */
#define FUSE_MR(T) (T == Q4_K ? 3 : MR_MAX)
#define BODY(T, MR, NH, h)                                                                                 \
    do {                                                                                                   \
        if (T == Q6_K)                                                                                     \
            kernel_q6k(MR, NH, w, K / QKK, xq, xd, xo, K, h, tile);                                        \
        else if (T == IQ4_XS)                                                                              \
            kernel_iq4xs(MR, NH, w, K / QKK, xq, xd, xo, K, h, tile);                                      \
        else if (T == Q4_K || T == Q5_K)                                                                   \
            kernel_k45(T, MR, NH, w, K / QKK, xq, xd, xo, K, h, tile);                                     \
        else                                                                                               \
            kernel(T, MR, NH, w, nb, xq, xd, xo, xm, K, h, tile);                                          \
    } while (0)
#define INSTANCE(T, MR)                                                                                    \
    static void kernel_##T##_##MR(const uint8_t *w, long nb, const int8_t *xq, const float *xd,           \
                                  const int32_t *xo, const float *xm, long K, float *tile) {               \
        if (MR <= FUSE_MR(T))                                                                              \
            BODY(T, MR, HALVES, 0);                                                                        \
        else                                                                                               \
            for (int h = 0; h < HALVES; h++) BODY(T, MR, 1, h);                                            \
    }
#define INSTANCES(T) INSTANCE(T, 1) INSTANCE(T, 2) INSTANCE(T, 3) INSTANCE(T, 4) MORE_INSTANCES(T)
#if MR_MAX == 8
#define MORE_INSTANCES(T) INSTANCE(T, 5) INSTANCE(T, 6) INSTANCE(T, 7) INSTANCE(T, 8)
#define TABLE(T) {0, kernel_##T##_1, kernel_##T##_2, kernel_##T##_3, kernel_##T##_4, kernel_##T##_5, \
                  kernel_##T##_6, kernel_##T##_7, kernel_##T##_8}
#else
#define MORE_INSTANCES(T)
#define TABLE(T) {0, kernel_##T##_1, kernel_##T##_2, kernel_##T##_3, kernel_##T##_4}
#endif
INSTANCES(2)
INSTANCES(3)
INSTANCES(6)
INSTANCES(7)
INSTANCES(8)
INSTANCES(12)
INSTANCES(13)
INSTANCES(14)
INSTANCES(20)
INSTANCES(23)
static const kernel_fn KERNELS_Q4_0[MR_MAX + 1] = TABLE(2);
static const kernel_fn KERNELS_Q4_1[MR_MAX + 1] = TABLE(3);
static const kernel_fn KERNELS_Q5_0[MR_MAX + 1] = TABLE(6);
static const kernel_fn KERNELS_Q5_1[MR_MAX + 1] = TABLE(7);
static const kernel_fn KERNELS_Q8_0[MR_MAX + 1] = TABLE(8);
static const kernel_fn KERNELS_Q4_K[MR_MAX + 1] = TABLE(12);
static const kernel_fn KERNELS_Q5_K[MR_MAX + 1] = TABLE(13);
static const kernel_fn KERNELS_Q6_K[MR_MAX + 1] = TABLE(14);
static const kernel_fn KERNELS_IQ4_NL[MR_MAX + 1] = TABLE(20);
static const kernel_fn KERNELS_IQ4_XS[MR_MAX + 1] = TABLE(23);

int matinee_quant_width(void) { return WIDTH; }

/* f32_to_bf16 (bf16.h) of each lane, in its low 16 bits: to nearest even by integer adds (denormals kept),
 * any NaN 0x7fc0. */
static inline vi bf16_lanes(vf v) {
#ifdef __AVX512F__
    const vi u = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(ANDI(u, SET1I(0x7fffffff)), SET1I(0x7f800000));
#else
    const vi u = _mm256_castps_si256(v);
    const vi nan = _mm256_cmpgt_epi32(ANDI(u, SET1I(0x7fffffff)), SET1I(0x7f800000));
#endif
    const vi r = SRLI32(ADDI(ADDI(u, SET1I(0x7fff)), ANDI(SRLI32(u, 16), SET1I(1))), 16);
#ifdef __AVX512F__
    return _mm512_mask_blend_epi32(nan, r, SET1I(0x7fc0));
#else
    return _mm256_blendv_epi8(r, SET1I(0x7fc0), nan);
#endif
}

/* rows x cols of a tile (+ bias) into y, as float32 or bf16. Without a bias the tile still gets + 0.0f
 * (a -0.0 comes out +0.0), as the scalar loop wrote it. */
static void emit(const float *tile, int rows, int cols, const float *bias, void *y, int y_bf16, long ldy) {
#ifdef __AVX512F__
    const __mmask16 m = (__mmask16)((1u << cols) - 1);   /* a group's columns past N are not y's */
    const vf b = bias ? _mm512_maskz_loadu_ps(m, bias) : VZERO();
    for (int r = 0; r < rows; r++) {
        vf v = VADD(_mm512_loadu_ps(tile + r * GR), b);
        if (y_bf16)
            _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)y + r * ldy, m, bf16_lanes(v));   /* vpmovdw */
        else
            _mm512_mask_storeu_ps((float *)y + r * ldy, m, v);
    }
#else
    const int whole = cols / LANES * LANES;   /* in vectors of 8; the rest of a partial group one by one */
    vf b[HALVES] = {VZERO(), VZERO()};
    for (int c = 0; bias && c < whole; c += LANES) b[c / LANES] = _mm256_loadu_ps(bias + c);
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < whole; c += LANES) {
            vf v = VADD(_mm256_loadu_ps(tile + r * GR + c), b[c / LANES]);
            if (y_bf16) {
                vi h = bf16_lanes(v);
                _mm_storeu_si128((__m128i *)((uint16_t *)y + r * ldy + c),
                                 _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
            } else {
                VSTORE((float *)y + r * ldy + c, v);
            }
        }
        for (int c = whole; c < cols; c++) {
            float v = tile[r * GR + c] + (bias ? bias[c] : 0.0f);
            if (y_bf16)
                ((uint16_t *)y)[r * ldy + c] = f32_to_bf16(v);
            else
                ((float *)y)[r * ldy + c] = v;
        }
    }
#endif
}

#ifndef __AVX512F__
/* ---- AVX2, many rows of x through a type of unsigned values (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): the
 * tokens in the lanes ----
 *
 * The kernels above put 8 weight rows in a vector's lanes and broadcast 4 bytes of one row of x per product: a
 * maddubs costs a broadcast, an int16 add and its share of the nibbles' unpacking, ~3.4 vector ops on a core's 4
 * pipes. Here the lanes are 8 tokens: x is laid out once per call as [step of 4 values][8 tokens][4], a group's
 * super-blocks are unpacked once to unsigned bytes [step][16 rows][4], and a product takes its 8 tokens' x
 * straight from memory against one broadcast of a weight row's 4 bytes, shared by TL_T vectors of tokens. The
 * integer sums per scale unit, per super-block (or block of 32) and its float32 step are the kernels' own, in the
 * same order: the two paths agree bit for bit. Q8_0, IQ4_NL and IQ4_XS keep the row kernels: their signed values
 * are unsigned only + 128, and two such products overflow maddubs's int16 pair. */
#define TL_T 3          /* vectors of 8 tokens per pass */
#define TL_NR 2         /* weight rows per pass */
#define TL_MIN_ROWS 16  /* a chunk's rows from which the tokens take the lanes */
#define TL_STEPS (QKK / 4)

/* A group's ns super-blocks unpacked: the values v [ns][64 steps][16 rows][4] (Q4_K 0..15, Q5_K 0..31, Q6_K
 * 0..63); the scale of each unit (Q4_K and Q5_K 8 of 32 values, Q6_K 16 of 16) in both int16 halves, sc [ns][units]
 * [16]; pairs [ns][P][16], Q4_K's and Q5_K's minimums 2t, 2t + 1 (P 4), Q6_K's scales 2t, 2t + 1 (P 8), as int16
 * halves; d and dmin [ns][16]. For the blocks of 32, ns blocks: v [ns][8 steps][16][4], d and (Q4_1, Q5_1) the
 * minimums m in dmin; no sc or pairs. */
typedef struct {
    uint8_t *v;
    int32_t *sc, *pairs;
    float *d, *dmin;
} unpacked;

static inline int tl_units(int type) { return type == Q6_K ? 16 : 8; }
static inline int tl_steps(int type) { return is_k(type) ? TL_STEPS : QK / 4; }   /* steps of 4 values a block */
static inline int tl_min(int type) { return type == Q4_1 || type == Q5_1; }
static inline int tl_pairs(int type) { return type == Q6_K ? 8 : 4; }

#define VSTOREI(p, v) _mm256_storeu_si256((__m256i *)(p), v)

/* A group's `units` scales (bytes at scp, GR a scale) into sc, and `np` pairs of the bytes at pp (2t, 2t + 1) into
 * pr, as the row kernels' scale_u8 / pair_u8 (or the signed ones) give them, 16 rows' lanes each. */
static void tl_scales(int is_signed, int32_t *sc, int32_t *pr, const uint8_t *scp, const uint8_t *pp, int units,
                      int np) {
    for (int j = 0; j < units; j++)
        for (int half = 0; half < 2; half++) {
            const uint8_t *at = scp + j * GR + half * LANES;
            VSTOREI(sc + j * GR + half * LANES, is_signed ? scale_i8(at) : scale_u8(at));
        }
    for (int t = 0; t < np; t++)
        for (int half = 0; half < 2; half++) {
            const uint8_t *a = pp + 2 * t * GR + half * LANES, *b = a + GR;
            VSTOREI(pr + t * GR + half * LANES, is_signed ? pair_i8(a, b) : pair_u8(a, b));
        }
}

/* A block's 16 float16 scales at blk as floats into d, and where dmin, the 16 float16 after them (minimums) too. */
static void tl_d(const uint8_t *blk, float *d, float *dmin) {
    for (int half = 0; half < 2; half++) {
        _mm256_storeu_ps(d + half * LANES, LOAD_F16(blk + half * LANES * 2));
        if (dmin) _mm256_storeu_ps(dmin + half * LANES, LOAD_F16(blk + 2 * GR + half * LANES * 2));
    }
}

static void unpack_group(int type, const uint8_t *g, long ns, unpacked *u) {
    const long gb = group_bytes(type);
    const int steps = tl_steps(type);
    if (!is_k(type)) {   /* ns blocks of 32: d and (Q4_1, Q5_1) m as floats, values [8 steps][16 rows][4] */
        const int q5 = type == Q5_0 || type == Q5_1;
        for (long b = 0; b < ns; b++) {
            const uint8_t *blk = g + b * gb, *qs = blk + (tl_min(type) ? 4 : 2) * GR;
            uint8_t *v = u->v + b * steps * GR * 4;
            tl_d(blk, u->d + b * GR, tl_min(type) ? u->dmin + b * GR : 0);
            for (int half = 0; half < 2; half++) {
                vi qh = q5 ? LOADI(qs + half * 32) : SET1I(0);
                for (int c = 0; c < 4; c++) {
                    vi lo, hi;
                    q45_values(q5, LOADI(qs + (q5 ? GR * 4 : 0) + c * GR * 4 + half * 32), &qh, &lo, &hi);
                    VSTOREI(v + c * GR * 4 + half * 32, lo);
                    VSTOREI(v + (4 + c) * GR * 4 + half * 32, hi);
                }
            }
        }
        return;
    }
    const int units = tl_units(type), np = tl_pairs(type);
    for (long s = 0; s < ns; s++) {
        const uint8_t *blk = g + s * gb;
        uint8_t *v = u->v + s * steps * GR * 4;
        int32_t *sc = u->sc + s * units * GR, *pr = u->pairs + s * np * GR;
        tl_d(blk, u->d + s * GR, type != Q6_K ? u->dmin + s * GR : 0);
        if (type == Q6_K) {
            const uint8_t *scp = blk + 2 * GR, *ql = blk + 18 * GR, *qhp = ql + 128 * GR;
            tl_scales(1, sc, pr, scp, scp, units, np);
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < 4; c++)
                    for (int half = 0; half < 2; half++) {
                        vi lo, hi;
                        q6k_values(LOADI(ql + (j * 4 + c) * GR * 4 + half * 32),
                                   LOADI(qhp + (j * 2 + c / 2) * GR * 4 + half * 32), c, &lo, &hi);
                        VSTOREI(v + (8 * j + c) * GR * 4 + half * 32, lo);
                        VSTOREI(v + (8 * j + 4 + c) * GR * 4 + half * 32, hi);
                    }
            continue;
        }
        const uint8_t *scp = blk + 4 * GR, *mnp = blk + 12 * GR, *qs = blk + 20 * GR, *qh = qs + 128 * GR;
        tl_scales(0, sc, pr, scp, mnp, units, np);
        for (int p = 0; p < 4; p++)
            for (int c = 0; c < 8; c++)
                for (int half = 0; half < 2; half++) {
                    vi lo, hi;
                    k45_values(type, LOADI(qs + (p * 8 + c) * GR * 4 + half * 32), qh + c * GR * 4 + half * 32, p,
                               &lo, &hi);
                    VSTOREI(v + (16 * p + c) * GR * 4 + half * 32, lo);
                    VSTOREI(v + (16 * p + 8 + c) * GR * 4 + half * 32, hi);
                }
    }
}

/* The int16 pair sums of a pass, row r and vector t at [r * T + t]: returned by value, so that they stay in
 * registers (through a pointer gcc kept them on the stack: the blocks of 32 took 1.3x the time). */
typedef struct {
    vi v[TL_NR * TL_T];
} tl_sums;

/* Steps [q0, q0 + run) of rows n0.. (v: their unpacked bytes from step 0) against T vectors of tokens (x, a vector's
 * steps xstride bytes after the last's). */
static inline __attribute__((always_inline)) tl_sums tl_steps_run(const int T, const uint8_t *v, const int8_t *x,
                                                                  long xstride, int q0, int run) {
    tl_sums part;
    for (int i = 0; i < TL_NR * T; i++) part.v[i] = SET1I(0);
    for (int q = q0; q < q0 + run; q++) {
        vi wr[TL_NR];
        for (int r = 0; r < TL_NR; r++) wr[r] = SET1I(bcast4((const int8_t *)v + q * GR * 4 + r * 4));
        for (int t = 0; t < T; t++) {
            const vi xv = LOADI(x + t * xstride + q * 32);
            for (int r = 0; r < TL_NR; r++) part.v[r * T + t] = ADD16(part.v[r * T + t], PAIRS16(wr[r], xv));
        }
        for (int i = 0; i < TL_NR * T; i++) KEEP(part.v[i]);   /* a step's sums added as they come, not regrouped */
    }
    return part;
}

/* Rows n0, n0 + TL_NR of super-block s against T vectors of 8 tokens: xt the tokens' x ([step][8][4], a vector's
 * steps `xstride` bytes after the last's), xd and xp their scales [ns][8] and pair sums [ns][P][8] (a vector's
 * `dstride` and `pstride` after the last's); facc [16][TL_T] vectors of float32 sums, as scale_super adds them. */
static inline __attribute__((always_inline)) void tl_pass(const int type, const int T, const unpacked *u, long s,
                                                          int n0, const int8_t *xt, long xstride, const float *xd,
                                                          long dstride, const int32_t *xp, long pstride, vf *facc) {
    const int units = tl_units(type), np = tl_pairs(type), per = TL_STEPS / units;
    /* int16 pair sums a widening holds: 8 of 2 * 15 * 127 (Q4_K), 4 of 2 * 31 * 127, 2 of 2 * 63 * 127 */
    const int run = type == Q4_K ? 8 : type == Q5_K ? 4 : 2;
    const uint8_t *v = u->v + s * TL_STEPS * GR * 4 + n0 * 4;
    const int8_t *x = xt + s * TL_STEPS * 32;
    vi dot[TL_NR * TL_T];
    for (int i = 0; i < TL_NR * T; i++) dot[i] = SET1I(0);
    for (int q0 = 0; q0 < TL_STEPS; q0 += run) {
        const tl_sums part = tl_steps_run(T, v, x, xstride, q0, run);
        const int32_t *sc = u->sc + (s * units + q0 / per) * GR + n0;
        for (int r = 0; r < TL_NR; r++) {
            const vi scale = SET1I(sc[r]);
            for (int t = 0; t < T; t++) dot[r * T + t] = ADDI(dot[r * T + t], MADD16(part.v[r * T + t], scale));
        }
    }
    vi less[TL_NR * TL_T];   /* Q4_K and Q5_K: sum(m * sum(x)); Q6_K: sum(sc * sum(x)), its offset of 32 */
    for (int i = 0; i < TL_NR * T; i++) less[i] = SET1I(0);
    for (int t2 = 0; t2 < np; t2++)
        for (int r = 0; r < TL_NR; r++) {
            const vi m = SET1I(u->pairs[(s * np + t2) * GR + n0 + r]);
            for (int t = 0; t < T; t++)
                less[r * T + t] = DOT_I16(less[r * T + t], m, LOADI(xp + t * pstride + (s * np + t2) * LANES));
        }
    for (int r = 0; r < TL_NR; r++) {
        const vf dw = VSET1(u->d[s * GR + n0 + r]), mw = VSET1(type == Q6_K ? 0.0f : u->dmin[s * GR + n0 + r]);
        for (int t = 0; t < T; t++) {
            const vf dx = _mm256_loadu_ps(xd + t * dstride + s * LANES);
            vf *f = facc + (n0 + r) * TL_T + t;
            vi d = dot[r * T + t];
            if (type == Q6_K) d = SUBI(d, SLLI32(less[r * T + t], 5));
            vf a = VMUL(CVT(d), VMUL(dw, dx));
            KEEP(a);
            *f = VADD(*f, a);
            if (type != Q6_K) {
                vf b = VMUL(CVT(less[r * T + t]), VMUL(mw, dx));
                KEEP(b);
                *f = VSUB(*f, b);
            }
        }
    }
}

/* tl_pass for the blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1): block b's int32 sum per row and token starts at the
 * offset's xo (xp here, [nb][8] a vector: Q4_0's -8 and Q5_0's -16 times sum(x); 0 for the others), the products'
 * int16 pairs widened after 8 steps (Q4) or 4 (Q5), then facc += sum * (d * d_x) and, for Q4_1 and Q5_1, + m * xm
 * (xm [nb][8]: d_x * sum(x)), as the row kernel adds them. */
static inline __attribute__((always_inline)) void tl_pass32(const int type, const int T, const unpacked *u, long b,
                                                            int n0, const int8_t *xt, long xstride, const float *xd,
                                                            long dstride, const int32_t *xp, long pstride,
                                                            const float *xm, vf *facc) {
    const int run = type == Q5_0 || type == Q5_1 ? 4 : 8;   /* pairs of 2 * 15 * 127 (2 * 31 * 127) an int16 holds */
    const int steps = tl_steps(type);
    const uint8_t *v = u->v + b * steps * GR * 4 + n0 * 4;
    const int8_t *x = xt + b * steps * 32;
    vi acc[TL_NR * TL_T];
    for (int r = 0; r < TL_NR; r++)
        for (int t = 0; t < T; t++) acc[r * T + t] = tl_min(type) ? SET1I(0) : LOADI(xp + t * pstride + b * LANES);
    for (int q0 = 0; q0 < steps; q0 += run) {
        const tl_sums part = tl_steps_run(T, v, x, xstride, q0, run);
        for (int i = 0; i < TL_NR * T; i++) acc[i] = WIDEN_PAIRS(acc[i], part.v[i]);
    }
    for (int r = 0; r < TL_NR; r++) {
        const vf dw = VSET1(u->d[b * GR + n0 + r]);
        for (int t = 0; t < T; t++) {
            vf *f = facc + (n0 + r) * TL_T + t;
            vf a = VMUL(CVT(acc[r * T + t]), VMUL(dw, _mm256_loadu_ps(xd + t * dstride + b * LANES)));
            KEEP(a);
            *f = VADD(*f, a);
            if (tl_min(type)) {
                vf c = VMUL(VSET1(u->dmin[b * GR + n0 + r]), _mm256_loadu_ps(xm + t * dstride + b * LANES));
                KEEP(c);
                *f = VADD(*f, c);
            }
        }
    }
}

/* One pass of either kind, by the type's blocks: xp is the K-quants' pair sums or the blocks of 32's offsets (a
 * vector's `pstride` after the last's), xm the minimums' multipliers (Q4_1, Q5_1; else unused). */
static inline __attribute__((always_inline)) void tl_pass_of(const int type, const int T, const unpacked *u, long s,
                                                             int n0, const int8_t *xt, long xstride, const float *xd,
                                                             long dstride, const int32_t *xp, long pstride,
                                                             const float *xm, vf *facc) {
    if (is_k(type))
        tl_pass(type, T, u, s, n0, xt, xstride, xd, dstride, xp, pstride, facc);
    else
        tl_pass32(type, T, u, s, n0, xt, xstride, xd, dstride, xp, pstride, xm, facc);
}

/* Every pass of one group over `rows` tokens (ceil(rows / 8) vectors of xt, xd, xp, laid out as tl_pass reads
 * them), their sums emitted into y as the row kernels' tiles are. */
static inline __attribute__((always_inline)) void tl_group(const int type, const unpacked *u, long ns,
                                                           const int8_t *xt, const float *xd, const int32_t *xp,
                                                           const float *xm, long rows, long K, int cols,
                                                           const float *bias, void *y, int y_bf16, long N) {
    const long vecs = (rows + LANES - 1) / LANES, xstride = K * LANES, dstride = ns * LANES;
    const long pstride = ns * (is_k(type) ? tl_pairs(type) : 1) * LANES;
    const size_t elem = y_bf16 ? sizeof(uint16_t) : sizeof(float);
    for (long t0 = 0; t0 < vecs; t0 += TL_T) {
        const int T = vecs - t0 < TL_T ? (int)(vecs - t0) : TL_T;
        const int8_t *x = xt + t0 * xstride;
        const float *d = xd + t0 * dstride;
        const int32_t *p = xp + t0 * pstride;
        const float *mx = xm ? xm + t0 * dstride : 0;
        vf facc[GR * TL_T];
        for (int i = 0; i < GR * TL_T; i++) facc[i] = VZERO();
        for (long s = 0; s < ns; s++)
            for (int n0 = 0; n0 < GR; n0 += TL_NR) {
                if (T == TL_T)
                    tl_pass_of(type, TL_T, u, s, n0, x, xstride, d, dstride, p, pstride, mx, facc);
                else if (T == 2)
                    tl_pass_of(type, 2, u, s, n0, x, xstride, d, dstride, p, pstride, mx, facc);
                else
                    tl_pass_of(type, 1, u, s, n0, x, xstride, d, dstride, p, pstride, mx, facc);
            }
        for (int t = 0; t < T; t++) {
            float sums[GR * LANES], tile[LANES * GR];   /* [row][token] to the tile's [token][row] */
            for (int n = 0; n < GR; n++) VSTORE(sums + n * LANES, facc[n * TL_T + t]);
            for (int k = 0; k < LANES; k++)
                for (int n = 0; n < GR; n++) tile[k * GR + n] = sums[n * LANES + k];
            const long m = (t0 + t) * LANES;
            emit(tile, rows - m < LANES ? (int)(rows - m) : LANES, cols, bias, (char *)y + m * N * elem, y_bf16, N);
        }
    }
}

typedef void (*tl_fn)(const unpacked *, long, const int8_t *, const float *, const int32_t *, const float *, long,
                      long, int, const float *, void *, int, long);
#define TL_GROUP(T)                                                                                              \
    static void tl_group_##T(const unpacked *u, long ns, const int8_t *xt, const float *xd, const int32_t *xp,   \
                             const float *xm, long rows, long K, int cols, const float *bias, void *y,          \
                             int y_bf16, long N) {                                                               \
        tl_group(T, u, ns, xt, xd, xp, xm, rows, K, cols, bias, y, y_bf16, N);                                  \
    }
TL_GROUP(2)
TL_GROUP(3)
TL_GROUP(6)
TL_GROUP(7)
TL_GROUP(12)
TL_GROUP(13)
TL_GROUP(14)

/* The token lanes' group function of a type, or 0 where it has none (Q8_0, IQ4_NL and IQ4_XS: signed values, whose
 * maddubs pairs of 2 * 128 * 127 an int16 cannot sum). */
static tl_fn tl_group_of(int type) {
    switch (type) {
    case Q4_0: return tl_group_2;
    case Q4_1: return tl_group_3;
    case Q5_0: return tl_group_6;
    case Q5_1: return tl_group_7;
    case Q4_K: return tl_group_12;
    case Q5_K: return tl_group_13;
    case Q6_K: return tl_group_14;
    default: return 0;
    }
}
#endif

/* n pairs of sums: the sum of `span` sums16 as a pair's low int16 half, the next `span`'s as its high one
 * (|a sum of 32| <= 32 * 127 fits). */
static void sum_pairs(const int32_t *sums16, int span, long n, int32_t *pairs) {
    for (long t = 0; t < n; t++) {
        const int32_t *at = sums16 + 2 * span * t;
        int32_t a = at[0], b = at[span];
        if (span == 2) a += at[1], b += at[3];
        pairs[t] = (int32_t)((uint32_t)(uint16_t)a | (uint32_t)b << 16);
    }
}

/* y = x @ W^T (+ bias). x is [M, K] bf16 (x_bf16) or float32, K a multiple of 32; w the packed weight
 * of `type`; bias float32 [N] or NULL; y [M, N] bf16 (y_bf16) or float32. Returns 0, -1 when out of
 * memory, -2 for a type it does not read, -3 for a K-quant whose K is not whole super-blocks. */
int matinee_quant_gemm(const void *x, int x_bf16, int type, const uint8_t *w, const float *bias, void *y,
                       int y_bf16, long M, long N, long K, int threads) {
    const kernel_fn *kernels = type == Q4_0 ? KERNELS_Q4_0 : type == Q4_1 ? KERNELS_Q4_1
                             : type == Q5_0 ? KERNELS_Q5_0 : type == Q5_1 ? KERNELS_Q5_1
                             : type == Q8_0 ? KERNELS_Q8_0 : type == Q4_K ? KERNELS_Q4_K
                             : type == Q5_K ? KERNELS_Q5_K : type == Q6_K ? KERNELS_Q6_K
                             : type == IQ4_NL ? KERNELS_IQ4_NL : type == IQ4_XS ? KERNELS_IQ4_XS : 0;
    if (!kernels) return -2;
    if (is_k(type) && K % QKK) return -3;
    long nb = K / QK, groups = (N + GR - 1) / GR;
    size_t qbytes = ((size_t)M * K + 63) & ~(size_t)63;
    int8_t *xq = aligned_alloc(64, qbytes ? qbytes : 64);
    float *xd = malloc((M * nb + 1) * sizeof(float));
    int32_t *xs = malloc((2 * M * nb + 1) * sizeof(int32_t)), *xo = malloc((M * nb + 1) * sizeof(int32_t));
    float *xm = malloc((M * nb + 1) * sizeof(float));
    if (!xq || !xd || !xs || !xo || !xm) {
        free(xq), free(xd), free(xs), free(xo), free(xm);
        return -1;
    }
    /* What a block of the 32-value types adds besides its products, per row: the offset's int32 start
     * value (-8, -16 or Q8_0's -Q8_BIAS times the sum of x), the minimum's multiplier d * sum in float32.
     * Worked out once per row and block, not once per group, and read by a broadcast from memory. */
    const int32_t offset = type == Q8_0 || type == IQ4_NL ? -Q8_BIAS : type == Q4_0 ? -8 : type == Q5_0 ? -16 : 0;
    /* A K-quant row's x: a scale per super-block (xd), its sums per 16 (xs), and those sums as the int16 pairs
     * its kernel reads (xo: per super-block Q6_K's 8 pairs of 16s, Q4_K's, Q5_K's and IQ4_XS's 4 pairs of 32s). */
    const long sd = is_k(type) ? K / QKK : nb, so = is_k(type) ? K / QKK * (type == Q6_K ? 8 : 4) : nb;
    long chunk = MAX_CHUNK_BYTES / K;
    if (chunk < MR_MAX) chunk = MR_MAX;
    const long gb = (is_k(type) ? K / QKK : nb) * group_bytes(type);   /* one group's whole stream */
    const size_t elem = y_bf16 ? sizeof(uint16_t) : sizeof(float);
    const long mr_max = is_k(type) ? MR_K : MR_MAX;
#ifndef __AVX512F__
    /* The tokens in the lanes (tl_group) for chunks of at least TL_MIN_ROWS rows of a type that has them: x laid out
     * again, [vector of 8 tokens][step][8][4], its scales, pair sums or offsets, and minimums' multipliers
     * [vector][block]([pair])[8]. */
    const tl_fn run = tl_group_of(type);
    const int lanes = run && (M < chunk ? M : chunk) >= TL_MIN_ROWS;
    if (lanes) chunk = chunk / LANES * LANES;   /* whole vectors of tokens */
    const long vecs = lanes ? (M + LANES - 1) / LANES : 0, blocks = is_k(type) ? K / QKK : nb;
    const long np = is_k(type) ? tl_pairs(type) : 0, units = is_k(type) ? tl_units(type) : 0;
    const long ubytes = blocks * (tl_steps(type) * GR * 4 + (units + np) * GR * 4 + 2 * GR * 4);
    int8_t *xt = lanes ? aligned_alloc(64, vecs * K * LANES) : 0;
    float *xdt = lanes ? malloc(sizeof(float) * vecs * sd * LANES) : 0;
    int32_t *xpt = lanes ? malloc(sizeof(int32_t) * vecs * so * LANES) : 0;
    float *xmt = lanes && tl_min(type) ? malloc(sizeof(float) * vecs * nb * LANES) : 0;
    /* a group unpacked a thread */
    uint8_t *ubuf = lanes ? aligned_alloc(64, (threads > 1 ? threads : 1) * ubytes) : 0;
    if (lanes && (!xt || !xdt || !xpt || !ubuf || (tl_min(type) && !xmt))) {
        free(xt), free(xdt), free(xpt), free(xmt), free(ubuf), free(xq), free(xd), free(xs), free(xo), free(xm);
        return -1;
    }
#else
    const int lanes = 0;
#endif
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (long m = 0; m < M; m++) {
            const void *row = (const char *)x + m * K * (x_bf16 ? 2 : 4);
            if (is_k(type)) {
                quantize_row_k(row, x_bf16, K, xq + m * K, xd + m * sd, xs + m * 2 * nb);
                sum_pairs(xs + m * 2 * nb, type == Q6_K ? 1 : 2, so, xo + m * so);
                continue;
            }
            quantize_row(row, x_bf16, K, xq + m * K, xd + m * nb, xs + m * nb);
            for (long b = m * nb; b < (m + 1) * nb; b++) xo[b] = offset * xs[b], xm[b] = xd[b] * (float)xs[b];
        }
#ifndef __AVX512F__
        if (lanes) {
#pragma omp for schedule(static)
            for (long v = 0; v < vecs; v++)
                for (int k = 0; k < LANES; k++) {
                    const long m = v * LANES + k, in = m < M;
                    const int32_t *from = (const int32_t *)(xq + m * K);
                    int32_t *to = (int32_t *)(xt + v * K * LANES) + k;
                    for (long q = 0; q < K / 4; q++) to[q * LANES] = in ? from[q] : 0;
                    for (long s = 0; s < sd; s++) xdt[(v * sd + s) * LANES + k] = in ? xd[m * sd + s] : 0.0f;
                    for (long t = 0; t < so; t++) xpt[(v * so + t) * LANES + k] = in ? xo[m * so + t] : 0;
                    for (long b = 0; xmt && b < nb; b++) xmt[(v * nb + b) * LANES + k] = in ? xm[m * nb + b] : 0.0f;
                }
            unpacked u;
            u.v = ubuf + omp_get_thread_num() * ubytes;
            u.sc = (int32_t *)(u.v + blocks * tl_steps(type) * GR * 4), u.pairs = u.sc + blocks * units * GR;
            u.d = (float *)(u.pairs + blocks * np * GR), u.dmin = u.d + blocks * GR;
            for (long m0 = 0; m0 < M; m0 += chunk) {
                const long rows = M - m0 < chunk ? M - m0 : chunk, v0 = m0 / LANES;
#pragma omp for schedule(static) nowait
                for (long g = 0; g < groups; g++) {
                    const int cols = N - g * GR < GR ? (int)(N - g * GR) : GR;
                    unpack_group(type, w + g * gb, blocks, &u);
                    run(&u, blocks, xt + v0 * K * LANES, xdt + v0 * sd * LANES, xpt + v0 * so * LANES,
                        xmt ? xmt + v0 * nb * LANES : 0, rows, K, cols, bias ? bias + g * GR : 0,
                        (char *)y + (m0 * N + g * GR) * elem, y_bf16, N);
                }
            }
        }
#endif
        for (long m0 = 0; !lanes && m0 < M; m0 += chunk) {
            long rows = M - m0 < chunk ? M - m0 : chunk;
#pragma omp for schedule(static) nowait
            for (long g = 0; g < groups; g++) {
                float tile[MR_MAX * GR] __attribute__((aligned(64)));
                int cols = N - g * GR < GR ? (int)(N - g * GR) : GR;
                long m = m0, left = rows;
                for (long parts = (rows + mr_max - 1) / mr_max; left > 0; parts--) {
                    int mr = (int)((left + parts - 1) / parts);   /* near-equal groups: 9 rows as 5 + 4 */
                    kernels[mr](w + g * gb, nb, xq + m * K, xd + m * sd, xo + m * so, xm + m * nb, K, tile);
                    emit(tile, mr, cols, bias ? bias + g * GR : 0, (char *)y + (m * N + g * GR) * elem, y_bf16, N);
                    m += mr;
                    left -= mr;
                }
            }
        }
    }
#ifndef __AVX512F__
    free(xt), free(xdt), free(xpt), free(xmt), free(ubuf);
#endif
    free(xq), free(xd), free(xs), free(xo), free(xm);
    return 0;
}

/* v into out[at] as float32 or, rounded once more, bf16. */
static inline void put(void *out, int out_bf16, long at, float v) {
    if (out_bf16)
        ((uint16_t *)out)[at] = f32_to_bf16(v);
    else
        ((float *)out)[at] = v;
}

/* Row `id` of a packed K-quant weight, dequantized as kquant.dequantize_raw gives it: Q4_K and Q5_K
 * (d * sc) * q - dmin * m, Q6_K (d * sc) * (q - 32), each product rounded to float32 on its own (no fused
 * multiply-add), into out[at, at + K). The value of column j of super-block s is where kquant.pack put it. */
static void kquant_row(int type, const uint8_t *w, long K, long id, void *out, int out_bf16, long at) {
    const long ns = K / QKK, gb = group_bytes(type), lane = id % GR;
    for (long s = 0; s < ns; s++) {
        const uint8_t *blk = w + ((id / GR) * ns + s) * gb;
        uint16_t dh, mh = 0;
        memcpy(&dh, blk + 2 * lane, 2);
        const float d = _cvtsh_ss(dh);
        if (type == Q6_K) {
            const uint8_t *ql = blk + 18 * GR, *qh = ql + 128 * GR;
            for (int j = 0; j < QKK; j++) {
                const int b = j / QK, half = (j % QK) / 16, c = (j % 16) / 4, k = j % 4;
                const uint8_t lo = ql[((b * 4 + c) * GR + lane) * 4 + k];
                const uint8_t hb = qh[((b * 2 + c / 2) * GR + lane) * 4 + k];
                const int q = (half ? lo >> 4 : lo & 15) | ((hb >> (2 * half + 4 * (c & 1))) & 3) << 4;
                float scale = d * (float)(int8_t)blk[2 * GR + (2 * b + half) * GR + lane];
                KEEP_S(scale);
                put(out, out_bf16, at + s * QKK + j, scale * (float)(q - 32));
            }
            continue;
        }
        if (type == IQ4_XS) {   /* (d * sc) * level, sc the file's 6 bits less 32 */
            const uint8_t *qs = blk + 10 * GR;
            for (int j = 0; j < QKK; j++) {
                const int sub = j / QK, c = (j % 16) / 4, k = j % 4;
                const uint8_t byte = qs[((sub * 4 + c) * GR + lane) * 4 + k];
                float scale = d * (float)(int8_t)blk[2 * GR + sub * GR + lane];
                KEEP_S(scale);
                put(out, out_bf16, at + s * QKK + j, scale * (float)IQ4_TABLE[j % QK < 16 ? byte & 15 : byte >> 4]);
            }
            continue;
        }
        memcpy(&mh, blk + 2 * GR + 2 * lane, 2);
        const float dmin = _cvtsh_ss(mh);
        const uint8_t *sc = blk + 4 * GR, *mn = blk + 12 * GR, *qs = blk + 20 * GR, *q5 = qs + 128 * GR;
        for (int j = 0; j < QKK; j++) {
            const int sub = j / QK, c = (j % QK) / 4, k = j % 4;
            const uint8_t byte = qs[(((sub / 2) * 8 + c) * GR + lane) * 4 + k];
            int q = sub & 1 ? byte >> 4 : byte & 15;
            if (type == Q5_K) q |= ((q5[(c * GR + lane) * 4 + k] >> sub) & 1) << 4;
            float scale = d * (float)sc[sub * GR + lane], low = dmin * (float)mn[sub * GR + lane];
            KEEP_S(scale);
            KEEP_S(low);
            float v = scale * (float)q;
            KEEP_S(v);
            put(out, out_bf16, at + s * QKK + j, v - low);
        }
    }
}

/* Rows ids[0, n) of a packed weight (an embedding's lookup), dequantized as quant_linear.dequantize gives
 * them: d * q, plus m for Q4_1 and Q5_1 (a K-quant's as kquant_row says), in float32, into out [n, K] as
 * float32 or, rounded once more, bf16. A token's row took ~15 small torch
 * ops there, 0.2 ms of a 10 ms one-token step. Returns 0; -2 for a type it does not read; -4 for an id
 * outside [0, N). */
int matinee_quant_rows(int type, const uint8_t *w, long N, long K, const long *ids, long n, void *out, int out_bf16) {
    if (type != Q4_0 && type != Q4_1 && type != Q5_0 && type != Q5_1 && type != Q8_0 && type != IQ4_NL && !is_k(type))
        return -2;
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -4;
    if (is_k(type)) {
        for (long i = 0; i < n; i++) kquant_row(type, w, K, ids[i], out, out_bf16, i * K);
        return 0;
    }
    const long nb = K / QK, gb = group_bytes(type);
    const int has_min = type == Q4_1 || type == Q5_1, q5 = type == Q5_0 || type == Q5_1;
    const float offset = type == Q4_0 ? 8.0f : type == Q5_0 ? 16.0f : 0.0f;
    for (long i = 0; i < n; i++) {
        const long group = ids[i] / GR, lane = ids[i] % GR;
        for (long b = 0; b < nb; b++) {
            const uint8_t *blk = w + (group * nb + b) * gb;
            uint16_t dh, mh = 0;
            memcpy(&dh, blk + 2 * lane, 2);
            if (has_min) memcpy(&mh, blk + 2 * GR + 2 * lane, 2);
            const float d = _cvtsh_ss(dh), m = _cvtsh_ss(mh);
            const uint8_t *vals = blk + (has_min ? 4 : 2) * GR;
            float q[QK];
            if (type == Q8_0) {
                for (int c = 0; c < QK; c++) q[c] = (float)(int8_t)vals[(c / 4) * GR * 4 + lane * 4 + c % 4];
            } else {
                uint32_t qh = 0;
                if (q5) memcpy(&qh, vals + lane * 4, 4), vals += GR * 4;
                for (int j = 0; j < QK / 2; j++) {   /* byte j: column j low, 16 + j high */
                    const uint8_t byte = vals[(j / 4) * GR * 4 + lane * 4 + j % 4];
                    if (type == IQ4_NL) {
                        q[j] = IQ4_TABLE[byte & 15], q[j + QK / 2] = IQ4_TABLE[byte >> 4];
                        continue;
                    }
                    q[j] = (float)((byte & 15) | (q5 ? ((qh >> j) & 1) << 4 : 0)) - offset;
                    q[j + QK / 2] = (float)((byte >> 4) | (q5 ? ((qh >> (j + QK / 2)) & 1) << 4 : 0)) - offset;
                }
            }
            for (int c = 0; c < QK; c++) {
                float v = d * q[c];   /* exact: 11 bits of d times at most 8 of q */
                if (has_min) v = v + m;   /* not + 0.0f for the others: a -0.0 stays -0.0 */
                put(out, out_bf16, i * K + b * QK + c, v);
            }
        }
    }
    return 0;
}
