/* Paged attention for short query runs (decode tokens, speculative verification) on the CPU.
 *
 * Each sequence reads its keys and values in place through the block table: no
 * gathered copy of the context, no padding to the batch's longest sequence. Every query row is
 * computed alone (scores, max, exp, sum, weighted values), so a row's result never depends on
 * the rest of the batch. Query row i of a sequence with q_len new tokens and seq_len tokens in all
 * sees keys [0, seq_len - q_len + i]. Built by cpu_native.py; the reference is paged_attention.py.
 *
 * Three kernels from one source: matinee_paged_attention (float32) and matinee_paged_attention_bf16
 * (q, caches and out in bfloat16), and matinee_paged_attention_quant (q and out in either, an int8 or
 * fp8 e4m3 cache with a float32 scale per block and KV head: kv_quant.py). All compute in float32
 * registers; bf16 -> f32 is a shift, f32 -> bf16 rounds to nearest even with integer ops, int8 widens
 * and converts, e4m3 is two masks, a shift and a multiply (e4m3.h), so AVX2 and FMA are all they need;
 * with AVX-512 the loops run 16 lanes wide, and with AVX-512 BF16 the bf16 scores take dpbf16 (with AMX, its
 * tiles: a step's 16 keys against a KV head's query rows in one product, the softmax four rows at once). A key's
 * scale multiplies its scores, a value's its softmax weights, so the loops over D read the codes alone.
 *
 * Decode reads each cached byte once, so the kernel is bound by how many cache lines a core has in
 * flight: with the blocks fetched ahead by hand and 4 keys scored per reduction it went from ~9 to
 * 11-16 GB/s in a SmolLM2 step on 2 Xeon cores (bench/attention_cpu.py). On 2 Zen 5 cores (~31 GB/s
 * for this kernel's reads alone) that kernel ran at 13-17 GB/s, and ~30-35 on data in L3: its compute
 * and its waits on memory added up. Three changes took it to 20-25 GB/s in bf16 and float32 (1.25-1.54x;
 * int8 1.85x, fp8 1.5x), ~40 GB/s in L3: the prefetches spread over the compute, a KV head and a cache
 * at a time (one burst per block was most of the loss: 14 -> 25 GB/s alone, see attend); K and V read
 * in one pass, KC keys per step of a running softmax; 8 keys reduced per tree under AVX-512.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "e4m3.h"
#include "vexp.h"

typedef unsigned short bf16;

/* What a cache holds. Each kernel passes a constant kind, so the branches on it fold. */
enum { F32, BF16, I8, FP8 };
static const long ELEMENT_SIZE[] = {4, 2, 1, 1};

#define QUERY_TILE 16       /* new tokens per work item: a longer run is cut into tiles, computed apart */

/* e4m3 codes widened to 32 bits -> their values (e4m3.h's e4m3_to_f32, eight or sixteen at a time). */
#define E4M3_BITS(c, and, or, slli, set1) or(slli(and(c, set1(0x7f)), 20), slli(and(c, set1(0x80)), 24))

/* Element access for any kind, as float32 (an int8 or fp8 code's value before its scale). */
static inline __m256 load8(const void *p, long i, int kind) {
    if (kind == BF16) {
        return bf16x8_to_f32(_mm_loadu_si128((const __m128i *)((const bf16 *)p + i)));
    }
    if (kind == I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const char *)p + i))));
    if (kind == FP8) {
        __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const char *)p + i)));
        __m256i bits = E4M3_BITS(c, _mm256_and_si256, _mm256_or_si256, _mm256_slli_epi32, _mm256_set1_epi32);
        return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(E4M3_BIAS_SHIFT));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

static inline float load1(const void *p, long i, int kind) {
    if (kind == BF16) return bf16_to_f32(((const bf16 *)p)[i]);
    if (kind == I8) return (float)((const signed char *)p)[i];
    if (kind == FP8) return e4m3_to_f32(((const unsigned char *)p)[i]);
    return ((const float *)p)[i];
}

static inline void store_bf16(bf16 *dst, const float *src, long n) {
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), nan = _mm256_set1_epi32(0x7fc0);
    long n8 = n & ~7L;
    for (long i = 0; i < n8; i += 8) {
        __m256 x = _mm256_loadu_ps(src + i);
        __m256i bits = _mm256_castps_si256(x);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half, lsb)), 16);
        r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
        /* Pack within each 128-bit lane, then take the two lanes' low halves. */
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_castsi256_si128(packed));
    }
    for (long i = n8; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

static inline float hsum(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* The widest float32 vector the build has: 16 lanes under AVX-512, else 8. */
#ifdef __AVX512F__
typedef __m512 vec;
#define W 16
static inline vec vload(const void *p, long i, int kind) {
    if (kind == BF16) {
        return bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)((const bf16 *)p + i)));
    }
    if (kind == I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const char *)p + i))));
    if (kind == FP8) {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const char *)p + i)));
        __m512i bits = E4M3_BITS(c, _mm512_and_si512, _mm512_or_si512, _mm512_slli_epi32, _mm512_set1_epi32);
        return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(E4M3_BIAS_SHIFT));
    }
    return _mm512_loadu_ps((const float *)p + i);
}
#define vloadf(p) _mm512_loadu_ps(p)
#define vstoref(p, a) _mm512_storeu_ps(p, a)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vset1(x) _mm512_set1_ps(x)
#define vzero() _mm512_setzero_ps()
/* Lanes i and i + 8 added: the 8-lane partial sums the reduction below takes. */
static inline __m256 fold(vec a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#define ROWS 3   /* query rows scored together: ROWS x KEYS = 24 accumulators of 32 registers */
#define KEYS 8   /* keys scored together, reduced by one transpose-add tree */
typedef __m256 kvec;   /* KEYS scores */
#define kadd _mm256_add_ps
#define kmul _mm256_mul_ps
#define kload _mm256_loadu_ps
#define kstore _mm256_storeu_ps
/* Lane j: the sum of a[j]'s lanes, in the same tree for every j: lanes paired within each 128-bit lane
 * (unpacks, one add per two keys, then per four), then the four 128-bit lanes (two shuffles, two adds per
 * eight keys). 24 operations for 8 keys, where a fold and hadds per 4 keys took 40. */
static inline kvec reduce_keys(const vec *a) {
#define PAIRS(x, y) _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y))
#define QUADS(x, y) _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))), \
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))))
    __m512 c0 = QUADS(PAIRS(a[0], a[1]), PAIRS(a[2], a[3])), c1 = QUADS(PAIRS(a[4], a[5]), PAIRS(a[6], a[7]));
#undef PAIRS
#undef QUADS
    /* c0, c1: keys 0-3, 4-7, a partial sum in each 128-bit lane. Lanes 0 + 2 and 1 + 3, then the halves. */
    __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x44), _mm512_shuffle_f32x4(c0, c1, 0xee));
    d = _mm512_shuffle_f32x4(d, d, 0xd8);
    return _mm256_add_ps(_mm512_castps512_ps256(d), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)));
}
/* The larger lane of a[i] and a[i + 8]: the 8 lanes a horizontal max takes. */
static inline __m256 fold_max(vec a) {
    return _mm256_max_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#define vexp exp16
#define vmax(a, b) _mm512_max_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vdiv(a, b) _mm512_div_ps(a, b)
/* a where t <= limit, lane by lane, else b */
#define vwhere_le(t, limit, a, b) _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(t, limit, _CMP_LE_OQ), a)
#else
typedef __m256 vec;
#define W 8
#define vload load8
#define vloadf(p) _mm256_loadu_ps(p)
#define vstoref(p, a) _mm256_storeu_ps(p, a)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vset1(x) _mm256_set1_ps(x)
#define vzero() _mm256_setzero_ps()
static inline __m256 fold(vec a) { return a; }
#define ROWS 3   /* ROWS x KEYS = 12 accumulators of 16 registers */
#define KEYS 4
typedef __m128 kvec;
#define kadd _mm_add_ps
#define kmul _mm_mul_ps
#define kload _mm_loadu_ps
#define kstore _mm_storeu_ps
static inline kvec reduce_keys(const vec *a) {
#define PAIRS(x, y) _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y))
    __m256 b0 = PAIRS(a[0], a[1]), b1 = PAIRS(a[2], a[3]);
#undef PAIRS
    __m256 c = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(b0), _mm256_castps_pd(b1))),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(b0), _mm256_castps_pd(b1))));
    return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}
static inline __m256 fold_max(vec a) { return a; }
#define vexp exp8
#define vmax(a, b) _mm256_max_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vdiv(a, b) _mm256_div_ps(a, b)
#define vwhere_le(t, limit, a, b) _mm256_blendv_ps(b, a, _mm256_cmp_ps(t, limit, _CMP_LE_OQ))
#endif
#define KC 16   /* keys per step of the running softmax: KC / KEYS calls of scores() per row group */

/* Scores of m <= ROWS query rows against the KEYS keys at cache[key[j]]: each key is loaded once for
 * all rows, and a row's KEYS sums are reduced together (reduce_keys, not one horizontal sum per score).
 * A score's summation order depends only on D, so a row's result does not depend on which rows or keys
 * share its call. qs: the rows in float32; qb: the same in bfloat16, for a bf16 cache. s[r * KC + j]
 * gets row r's score against key j, times mult[j]. */
static inline void scores(const float *const *qs, const bf16 *const *qb, int m, const void *cache, const long *key,
                          long D, float *s, const float *mult, int kind) {
    vec a[ROWS][KEYS];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < KEYS; j++) a[r][j] = vzero();
    long dw;
#ifdef __AVX512BF16__
    if (kind == BF16) {   /* products of bf16 are exact in float32: dpbf16 sums them in pairs, with no widening
                      * (it counts denormal inputs as zero) */
        dw = D - D % 32;
        for (long d = 0; d < dw; d += 32)
            for (int j = 0; j < KEYS; j++) {
                __m512bh k = (__m512bh)_mm512_loadu_si512((const bf16 *)cache + key[j] + d);
                for (int r = 0; r < ROWS; r++)
                    if (r < m) a[r][j] = _mm512_dpbf16_ps(a[r][j], (__m512bh)_mm512_loadu_si512(qb[r] + d), k);
            }
    } else
#endif
    {
        dw = D - D % W;
        for (long d = 0; d < dw; d += W)
            for (int j = 0; j < KEYS; j++) {
                vec k = vload(cache, key[j] + d, kind);
                for (int r = 0; r < ROWS; r++)
                    if (r < m) a[r][j] = vfma(vloadf(qs[r] + d), k, a[r][j]);
            }
    }
    for (int r = 0; r < m; r++) {
        kvec sum = reduce_keys(a[r]);
        if (dw < D) {
            float tail[KEYS] = {0};
            for (int j = 0; j < KEYS; j++)
                for (long d = dw; d < D; d++) tail[j] += qs[r][d] * load1(cache, key[j] + d, kind);
            sum = kadd(sum, kload(tail));
        }
        kstore(s + r * KC, kmul(sum, kload(mult)));
    }
}

/* For the m <= 4 rows r of one KV head: o[r][D] = o[r][D] * c[r] + sum over k < n of w[r][k] * cache[value[k], +D),
 * k in order, row r's weight for key k at w[r * w_stride + k * w_step]: each value loaded once for the rows,
 * the rows' running sums in registers. (All of D = 64 in one pass, 16 chains side by side under AVX-512,
 * measured no faster than 2 W columns at a time.) */
static inline void weighted_sums(float *restrict o, const float *w, long w_stride, long w_step, const float *c, int m,
                                 long n, const void *cache, const long *value, long D, int kind) {
    const float *w0 = w, *w1 = w + w_stride, *w2 = w + 2 * w_stride, *w3 = w + 3 * w_stride;
    float *o0 = o, *o1 = o + D, *o2 = o + 2 * D, *o3 = o + 3 * D;
    vec c0 = vset1(c[0]), c1 = vset1(m > 1 ? c[1] : 0.f), c2 = vset1(m > 2 ? c[2] : 0.f), c3 = vset1(m > 3 ? c[3] : 0.f);
    long d = 0;
    for (; d + 2 * W <= D; d += 2 * W) {
        vec a0 = vmul(vloadf(o0 + d), c0), b0 = vmul(vloadf(o0 + d + W), c0), a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0,
            b3 = a0;
        if (m > 1) a1 = vmul(vloadf(o1 + d), c1), b1 = vmul(vloadf(o1 + d + W), c1);
        if (m > 2) a2 = vmul(vloadf(o2 + d), c2), b2 = vmul(vloadf(o2 + d + W), c2);
        if (m > 3) a3 = vmul(vloadf(o3 + d), c3), b3 = vmul(vloadf(o3 + d + W), c3);
        for (long k = 0; k < n; k++) {
            long v = value[k] + d, kw = k * w_step;
            vec lo = vload(cache, v, kind), hi = vload(cache, v + W, kind), wk = vset1(w0[kw]);
            a0 = vfma(wk, lo, a0), b0 = vfma(wk, hi, b0);
            if (m > 1) wk = vset1(w1[kw]), a1 = vfma(wk, lo, a1), b1 = vfma(wk, hi, b1);
            if (m > 2) wk = vset1(w2[kw]), a2 = vfma(wk, lo, a2), b2 = vfma(wk, hi, b2);
            if (m > 3) wk = vset1(w3[kw]), a3 = vfma(wk, lo, a3), b3 = vfma(wk, hi, b3);
        }
        vstoref(o0 + d, a0), vstoref(o0 + d + W, b0);
        if (m > 1) vstoref(o1 + d, a1), vstoref(o1 + d + W, b1);
        if (m > 2) vstoref(o2 + d, a2), vstoref(o2 + d + W, b2);
        if (m > 3) vstoref(o3 + d, a3), vstoref(o3 + d + W, b3);
    }
    for (int r = 0; r < m; r++) {   /* the last D % (2 W) columns, a row at a time */
        const float *wr = w + r * w_stride;
        float *or = o + r * D;
        long e = d;
        for (; e + 8 <= D; e += 8) {
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(or + e), _mm256_set1_ps(c[r]));
            for (long k = 0; k < n; k++)
                a = _mm256_fmadd_ps(_mm256_set1_ps(wr[k * w_step]), load8(cache, value[k] + e, kind), a);
            _mm256_storeu_ps(or + e, a);
        }
        for (; e < D; e++) {
            float a = or[e] * c[r];
            for (long k = 0; k < n; k++) a = fmaf(wr[k * w_step], load1(cache, value[k] + e, kind), a);
            or[e] = a;
        }
    }
}

static const float IOTA[KC] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* One step of a row's running softmax: s holds its scores against the step's n <= KC keys (lanes past n
 * are read and ignored). They become their weights e^(s - max), with max the largest score so far; *max
 * and *sum (the weights' sum so far) take them in. Returns the factor e^(old max - new max) by which the
 * row's earlier weights, and the sums of values they weighed, shrink: 1, exactly, while the max holds,
 * and 0 at the first step. */
static inline float running_softmax(float *s, long n, float *max, float *sum) {
    vec x[KC / W], limit = vset1((float)(n - 1));
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int v = 0; v < KC / W; v++) {
        x[v] = vwhere_le(vloadf(IOTA + v * W), limit, vloadf(s + v * W), vset1(-INFINITY));
        mv = _mm256_max_ps(mv, fold_max(x[v]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float step_max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))), old = *max, c = 1.f;
    if (step_max > old) {
        c = old == -INFINITY ? 0.f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(old - step_max)));
        *max = step_max;
    }
    vec maxv = vset1(*max), total = vzero();
    for (int v = 0; v < KC / W; v++) {
        vec e = vwhere_le(vloadf(IOTA + v * W), limit, vexp(vsub(x[v], maxv)), vzero());
        vstoref(s + v * W, e);
        total = vadd(total, e);
    }
    *sum = *sum * c + hsum(fold(total));
    return c;
}

#ifdef AMX_BF16
/* ---- A bf16 cache's scores on AMX's tiles (D a multiple of 32, at most 16 query heads per KV head) ----
 *
 * A step's scores for one KV head are one product, S^T = K Q^T: its KC = 16 keys, as they lie in the cache,
 * are the A tile's rows, and the group's query rows the B tile's columns. A bf16 row's consecutive pairs are
 * its 32-bit elements, so the B tile is the rows' 32-bit words transposed, once per item. The C tile holds
 * a key per row and a query head per column: the running softmax takes four heads at a time, a head per
 * float of each 128-bit lane, four keys per vector, with no transpose. (The AVX-512 BF16 scores spent as
 * much on reducing their sums across lanes as on their products: at 4 query heads a KV head, the 1B Llama
 * shape, they made 12 multiply-adds a cycle.) */

/* Query rows q[0, m) of D bf16 each, as the B tiles of their scores: qp[p][16] holds the pair p (values 2p,
 * 2p + 1) of each row, a row a column, columns past m zero; the tile for values [d, d + 32) is at qp + d * 8. */
static inline void query_pairs(uint32_t *qp, const bf16 *q, long m, long D) {
    memset(qp, 0, sizeof(uint32_t) * 8 * D);
    for (long c = 0; c < m; c++)
        for (long p = 0; p < D / 2; p++) qp[p * 16 + c] = ((const uint32_t *)(q + c * D))[p];
}

/* st[16][16]: the scores of 16 keys (rows of D bf16, `stride` bytes apart from k) against the query rows of qp. */
static inline void tile_scores(const bf16 *k, long stride, const uint32_t *qp, long D, float *st) {
    _tile_zero(0);
    for (long d = 0; d < D; d += 32) {
        _tile_loadd(1, k + d, stride);
        _tile_loadd(2, qp + d * 8, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, st, 64);
}

/* Lane l of vector v holds key 4v + l / 4 (and query head l % 4 of the four). */
static const float KEY_OF_LANE[64] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5,
                                      6, 6, 6, 6, 7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11,
                                      12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15};

/* running_softmax for the m <= 4 rows of columns [0, m) of st (a step's tile_scores, from its first column of
 * the four), times scale, keys past n ignored: w[4 k + r] gets row r's weight for key k, max[r] and sum[r]
 * take the step in, and c[r] is the factor its earlier sums shrink by. The same steps as running_softmax, a
 * row per lane of a 128-bit quarter. */
static inline void running_softmax4(const float *st, long n, float scale, float *max, float *sum, float *w, float *c,
                                    int m) {
    const __mmask8 rows = (__mmask8)((1 << m) - 1);
    const vec limit = vset1((float)(n - 1));
    vec x[4], top = vset1(-INFINITY);
    for (int v = 0; v < 4; v++) {
        const float *k = st + 4 * v * 16;
        vec a = _mm512_castps128_ps512(_mm_loadu_ps(k));
        a = _mm512_insertf32x4(a, _mm_loadu_ps(k + 16), 1);
        a = _mm512_insertf32x4(a, _mm_loadu_ps(k + 32), 2);
        a = _mm512_insertf32x4(a, _mm_loadu_ps(k + 48), 3);
        x[v] = vwhere_le(vloadf(KEY_OF_LANE + 16 * v), limit, vmul(a, vset1(scale)), vset1(-INFINITY));
        top = vmax(top, x[v]);
    }
    top = vmax(top, _mm512_shuffle_f32x4(top, top, _MM_SHUFFLE(1, 0, 3, 2)));
    top = vmax(top, _mm512_shuffle_f32x4(top, top, _MM_SHUFFLE(2, 3, 0, 1)));
    __m128 old = _mm_maskz_loadu_ps(rows, max), step = _mm512_castps512_ps128(top);
    __mmask8 grew = _mm_cmp_ps_mask(step, old, _CMP_GT_OQ), first = _mm_cmp_ps_mask(old, _mm_set1_ps(-INFINITY), _CMP_EQ_OQ);
    __m128 now = _mm_mask_mov_ps(old, grew, step);
    __m128 shrink = _mm512_castps512_ps128(exp16(_mm512_zextps128_ps512(_mm_sub_ps(old, now))));
    __m128 f = _mm_mask_mov_ps(_mm_set1_ps(1.f), grew, _mm_mask_mov_ps(shrink, first, _mm_setzero_ps()));
    vec top4 = _mm512_broadcast_f32x4(now), total = vzero();
    for (int v = 0; v < 4; v++) {
        vec e = vwhere_le(vloadf(KEY_OF_LANE + 16 * v), limit, vexp(vsub(x[v], top4)), vzero());
        vstoref(w + 16 * v, e);
        total = vadd(total, e);
    }
    total = vadd(total, _mm512_shuffle_f32x4(total, total, _MM_SHUFFLE(1, 0, 3, 2)));
    total = vadd(total, _mm512_shuffle_f32x4(total, total, _MM_SHUFFLE(2, 3, 0, 1)));
    _mm_mask_storeu_ps(max, rows, now);
    _mm_mask_storeu_ps(sum, rows, _mm_add_ps(_mm_mul_ps(_mm_maskz_loadu_ps(rows, sum), f), _mm512_castps512_ps128(total)));
    _mm_storeu_ps(c, f);
}
#endif

/* The metadata the kernel follows blindly, checked once per call (a few hundred integers, against
 * ~30 small torch ops per layer when the launcher checked them): 0 when consistent, -2 when the
 * query ranges and lengths disagree (or a length passes its table row), -3 for a block id outside
 * the pool. */
static int check_metadata(const int *block_tables, const int *query_start_loc, const int *seq_lens, long B, long T,
                          long block_size, long table_width, long num_blocks) {
    if (query_start_loc[0] != 0 || query_start_loc[B] != T) return -2;
    for (long b = 0; b < B; b++) {
        long q_len = (long)query_start_loc[b + 1] - query_start_loc[b];
        if (q_len < 0 || q_len > seq_lens[b] || seq_lens[b] > table_width * block_size) return -2;
    }
    for (long i = 0; i < B * table_width; i++)
        if (block_tables[i] < 0 || block_tables[i] >= num_blocks) return -3;
    return 0;
}

/* Blocks are scattered through the pool, so the hardware prefetcher, which restarts at each one,
 * leaves a core waiting on memory: the next blocks are fetched by hand, AHEAD tokens before they are
 * read (on Zen 5, 16 to 64 measured alike; how the fetches are spread over the compute mattered: see
 * attend). Into L1 (prefetcht0) or L2 (prefetcht1), as matinee_attention_prefetch_to last set: on a Zen 4
 * the L2 lines let twice the reads be in flight (7.5 -> 15.9 GB/s for SmolLM2's bf16 decode at batch 32,
 * bench/attention_cpu.py), where Zen 5 had measured 20-25 GB/s into L1. paged_attention_cpu.py measures
 * both once per machine and picks. Prefetches the elements [first, first + width) of each token's cache
 * row in the blocks starting at tokens [from, until), until <= span, and returns the first block start not
 * fetched. */
#define AHEAD 32
static int prefetch_level = 1;

/* 1: into L1, 2: into L2; anything else leaves the level as it is. Returns the level now in force. */
int matinee_attention_prefetch_to(int level) {
    if (level == 1 || level == 2) prefetch_level = level;
    return prefetch_level;
}

static inline long prefetch(const void *cache, const long *slot, long from, long until, long block_size,
                            long span, long first, long width, int kind) {
    long size = ELEMENT_SIZE[kind];
    const int l2 = prefetch_level == 2;
    for (; from < until; from += block_size)
        for (long t = from; t < from + block_size && t < span; t++) {
            const char *row = (const char *)cache + (slot[t] + first) * size;
            for (long x = 0; x < width * size; x += 64) {
                if (l2)
                    _mm_prefetch(row + x, _MM_HINT_T1);
                else
                    _mm_prefetch(row + x, _MM_HINT_T0);
            }
        }
    return from;
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    const float *k_scales, *v_scales;   /* [num_blocks, Hk] for an int8 or fp8 cache, else NULL */
    const int *block_tables, *query_start_loc, *seq_lens;
    void *out;
    long Hq, Hk, D, block_size, table_width;
    float scale;
} Problem;

/* The new tokens of sequence b's query tile at i0: QUERY_TILE, or what is left of its run. */
static inline long tile_tokens(const Problem *pb, long b, long i0) {
    long q_len = pb->query_start_loc[b + 1] - pb->query_start_loc[b];
    return q_len - i0 < QUERY_TILE ? q_len - i0 : QUERY_TILE;
}

/* The rows of KV heads [h0, h1) for new tokens [i0, i0 + QUERY_TILE) of sequence b; 0, or -1 when
 * its scratch cannot be had. q and out hold bf16 when act_bf16, else float32; the caches, `kind`.
 *
 * The tile's rows are (new token, query head), token-major. The context is walked KC keys at a time
 * with a running softmax (flash attention's running max and sum): a step's keys are scored, weighed and
 * their values summed at once, so each block's K and V are read back to back, while still in L1, and
 * the scores never go through memory. A slot's keys for every KV head lie side by side, so a step reads
 * the slots of its keys whole, every head in turn; each key serves every row that sees it. (Walking one
 * KV head's keys at a time instead measured twice slower with the hardware prefetcher alone: 256 of
 * every 768 bytes.) Steps start at multiples of KC from key 0 whatever the block size, so a row's
 * arithmetic depends only on its query, the keys it sees and D. */
static inline __attribute__((always_inline)) int attend(const Problem *pb, long b, long i0, long h0, long h1,
                                                        long k0, long k1, float *part, int act_bf16, int kind) {
    long Hq = pb->Hq, D = pb->D, block_size = pb->block_size;
    long group = Hq / pb->Hk, slot_stride = pb->Hk * D;   /* elements between consecutive slots of one block */
    long first = pb->query_start_loc[b], q_len = pb->query_start_loc[b + 1] - first, n = tile_tokens(pb, b, i0);
    /* Tile token i sees keys [0, past + i]; the tile reads keys [0, span). */
    long past = pb->seq_lens[b] - q_len + i0, span = past + n, rows = n * Hq;
    long end = part != NULL && k1 < span ? k1 : span;   /* the keys this call walks: [k0, end) */
    const int *table = pb->block_tables + b * pb->table_width;
#ifdef AMX_BF16
    const int tiles = kind == BF16 && D % 32 == 0 && group <= 16 && amx_permitted();
#else
    const int tiles = 0;
#endif
    /* Scratch: the slots, each row's running max and sum, a row group's scores, and for bf16 q and out,
     * the rows widened and their sums; on the tiles, each (token, KV head)'s query pairs, a step's scores
     * and weights, and its keys where they do not lie a slot apart. */
    long pairs = tiles ? n * (h1 - h0) * 8 * D : 0;
    long *slot = malloc(sizeof(long) * span + sizeof(float) * (2 * rows + group * KC + (act_bf16 ? 2 * rows * D : 0)) +
                        (tiles ? sizeof(float) * (pairs + 16 * 16 + 4 * KC + 8 * D) : 0));
    if (slot == NULL) return -1;
    float *run_max = (float *)(slot + span), *run_sum = run_max + rows, *s = run_sum + rows;
#ifdef AMX_BF16
    float *st = s + group * KC + (act_bf16 ? 2 * rows * D : 0), *wt = st + 16 * 16;
    uint32_t *qp = (uint32_t *)(wt + 4 * KC);
    bf16 *gathered = (bf16 *)(qp + pairs);
#endif
    /* Slot t's row (every KV head) starts at slot[t] in either cache: the table is walked a block
     * at a time, with no division per token. */
    for (long t0 = k0 / block_size * block_size, t = t0; t0 < end; t0 += block_size) {
        long base = (long)table[t0 / block_size] * block_size;
        for (long j = 0; j < block_size && t < end; j++, t++) slot[t] = (base + j) * slot_stride;
    }
    /* Row r = token * Hq + head: q and out rows are consecutive in memory, those of one token's
     * heads [h0, h1) too. bf16 queries are widened once, and bf16 outputs summed in float32 before
     * one rounding. */
    long row0 = (first + i0) * Hq * D, heads = (h1 - h0) * group * D;   /* a token's elements of the range */
    const float *qf = (const float *)pb->q + row0;
    float *acc = part != NULL ? part : (float *)pb->out + row0;
    if (act_bf16) {
        float *wide = s + group * KC;
        if (part == NULL) acc = wide + rows * D;
        for (long i = 0; i < n; i++)
            for (long e = (i * Hq + h0 * group) * D; e < (i * Hq + h0 * group) * D + heads; e++)
                wide[e] = load1(pb->q, row0 + e, 1);
        qf = wide;
    }
    for (long i = 0; i < n; i++) memset(acc + (i * Hq + h0 * group) * D, 0, sizeof(float) * heads);
    for (long r = 0; r < rows; r++) run_max[r] = -INFINITY, run_sum[r] = 0.f;
#ifdef AMX_BF16
    if (tiles) {
        for (long i = 0; i < n; i++)
            for (long h = h0; h < h1; h++)
                query_pairs(qp + (i * (h1 - h0) + h - h0) * 8 * D, (const bf16 *)pb->q + row0 + (i * Hq + h * group) * D,
                            group, D);
        configure_tiles();
    }
#endif
    long fetched = k0;
    for (long t0 = k0; t0 < end; t0 += KC) {
        long t1 = t0 + KC < end ? t0 + KC : end;
        /* Keys [fetched, ahead) are fetched during this step, a KV head at a time, K before its scores and V
         * before its sums: all of a step's lines at once (both caches, every head) measured 14 GB/s, against
         * 25 spread so. */
        long ahead = fetched < end && fetched <= t0 + AHEAD ? (t1 + AHEAD < end ? t1 + AHEAD : end) : fetched, next = fetched;
        /* Past t1, the last key stands in and its scores go unused. A key's block, for its scales. */
        long slots[KC], blocks[KC];
        for (long j = 0, bi = t0 / block_size, bo = t0 % block_size; j < KC; j++) {
            slots[j] = slot[t0 + j < t1 ? t0 + j : t1 - 1];
            blocks[j] = table[bi];
            if (t0 + j + 1 < t1 && ++bo == block_size) bi++, bo = 0;
        }
#ifdef AMX_BF16
        int apart = tiles;   /* on the tiles: the step's keys a slot apart, as a tile loads them */
        for (int j = 1; j < KC && apart; j++) apart = slots[j] == slots[0] + j * slot_stride;
#endif
        long i_first = t0 > past ? t0 - past : 0;   /* the first token that sees key t0 */
        for (long i = i_first; i < n; i++) {
            long seen = (past + i + 1 < t1 ? past + i + 1 : t1) - t0;
            for (long h = h0; h < h1; h++) {
                if (i == i_first && fetched < ahead) prefetch(pb->k_cache, slot, fetched, ahead, block_size, end, h * D, D, kind);
                long at[KC];
                float kmult[KC], vmult[KC];   /* the softmax scale, times each key's own for a quantized cache */
                for (int j = 0; j < KC; j++) {
                    at[j] = slots[j] + h * D;
                    kmult[j] = kind >= I8 ? pb->scale * pb->k_scales[blocks[j] * pb->Hk + h] : pb->scale;
                    if (kind >= I8) vmult[j] = pb->v_scales[blocks[j] * pb->Hk + h];
                }
                long r0 = i * Hq + h * group;
#ifdef AMX_BF16
                if (tiles) {
                    const bf16 *k = (const bf16 *)pb->k_cache + at[0];
                    if (!apart) {
                        for (int j = 0; j < KC; j++) memcpy(gathered + j * D, (const bf16 *)pb->k_cache + at[j], sizeof(bf16) * D);
                        k = gathered;
                    }
                    tile_scores(k, apart ? slot_stride * sizeof(bf16) : D * sizeof(bf16),
                                qp + (i * (h1 - h0) + h - h0) * 8 * D, D, st);
                }
#endif
                for (long g0 = 0; g0 < group && !tiles; g0 += ROWS) {
                    int m = group - g0 < ROWS ? (int)(group - g0) : ROWS;
                    const float *qs[ROWS];
                    const bf16 *qb[ROWS];
                    for (int x = 0; x < m; x++) qs[x] = qf + (r0 + g0 + x) * D, qb[x] = (const bf16 *)pb->q + row0 + (r0 + g0 + x) * D;
                    for (long j0 = 0; j0 < seen; j0 += KEYS)
                        scores(qs, qb, m, pb->k_cache, at + j0, D, s + g0 * KC + j0, kmult + j0, kind);
                }
                if (i == i_first && fetched < ahead)
                    next = prefetch(pb->v_cache, slot, fetched, ahead, block_size, end, h * D, D, kind);
                float c[4];
                for (long g0 = 0; g0 < group; g0 += 4) {
                    int m = group - g0 < 4 ? (int)(group - g0) : 4;
                    /* row x's weight for key j: w[x * w_stride + j * w_step] */
                    const float *w = s + g0 * KC;
                    long w_stride = KC, w_step = 1;
#ifdef AMX_BF16
                    if (tiles) {
                        running_softmax4(st + g0, seen, pb->scale, run_max + r0 + g0, run_sum + r0 + g0, wt, c, m);
                        w = wt, w_stride = 1, w_step = 4;
                    } else
#endif
                        for (int x = 0; x < m; x++) {
                            long r = r0 + g0 + x;
                            float *wx = s + (g0 + x) * KC;
                            c[x] = running_softmax(wx, seen, run_max + r, run_sum + r);
                            if (kind >= I8)   /* each weight times its value's scale */
                                for (long j = 0; j < seen; j++) wx[j] *= vmult[j];
                        }
                    weighted_sums(acc + (r0 + g0) * D, w, w_stride, w_step, c, m, seen, pb->v_cache, at, D, kind);
                }
            }
        }
        fetched = next;
    }
#ifdef AMX_BF16
    if (tiles) _tile_release();
#endif
    if (part != NULL) {   /* a part of the context: its sums unscaled, with each row's max and sum, for merge() */
        for (long i = 0; i < n; i++)
            for (long r = i * Hq + h0 * group; r < i * Hq + h1 * group; r++)
                part[rows * D + r] = run_max[r], part[rows * D + rows + r] = run_sum[r];
        free(slot);
        return 0;
    }
    for (long i = 0; i < n; i++)
        for (long r = i * Hq + h0 * group; r < i * Hq + h1 * group; r++) {
            vec inv = vset1(1.f / run_sum[r]);
            long d = 0;
            for (; d + W <= D; d += W) vstoref(acc + r * D + d, vmul(vloadf(acc + r * D + d), inv));
            for (; d < D; d++) acc[r * D + d] *= 1.f / run_sum[r];
        }
    if (act_bf16)
        for (long i = 0; i < n; i++) {
            long e = (i * Hq + h0 * group) * D;
            store_bf16((bf16 *)pb->out + row0 + e, acc + e, heads);
        }
    free(slot);
    return 0;
}

/* CALL(act_bf16, kind) for the combinations the kernels take, each with its arguments constant. */
#define EACH_KIND(act_bf16, kind, CALL)       \
    switch ((act_bf16) * 4 + (kind)) {        \
    case F32: return CALL(0, F32);            \
    case I8: return CALL(0, I8);              \
    case FP8: return CALL(0, FP8);            \
    case 4 + BF16: return CALL(1, BF16);      \
    case 4 + I8: return CALL(1, I8);          \
    case 4 + FP8: return CALL(1, FP8);        \
    }                                         \
    return -1;

static int attend_any(const Problem *pb, long b, long i0, long h0, long h1, long k0, long k1, float *part,
                      int act_bf16, int kind) {
#define ATTEND(a, k) attend(pb, b, i0, h0, h1, k0, k1, part, a, k)
    EACH_KIND(act_bf16, kind, ATTEND)
#undef ATTEND
}

/* A row's context is walked in parts of SEG keys, from key 0, where it is longer than one: each part a work
 * item of its own, their sums merged after. A lone decode at 2,000 keys had three items (its KV heads,
 * each reading a third of every slot), two of them on one core. The parts start at multiples of SEG
 * whatever the batch and the threads, so a row's arithmetic still depends only on its query, the keys
 * it sees and D. */
#define SEG 512

/* The rows of sequence b's tile at i0 from its nseg parts (attend's partial sums in part, each rows x D
 * sums, then the rows' maxima and sums): each part's sums and sum scaled by e^(its max - the largest), in
 * part order, and the total divides them, into out. */
static void merge(const Problem *pb, long b, long i0, long nseg, const float *part, int act_bf16) {
    long Hq = pb->Hq, D = pb->D, rows = tile_tokens(pb, b, i0) * Hq, size = rows * (D + 2);
    long row0 = (pb->query_start_loc[b] + i0) * Hq * D;
    float o[D];
    for (long r = 0; r < rows; r++) {
        float top = -INFINITY, total = 0.f;
        for (long g = 0; g < nseg; g++) top = fmaxf(top, part[g * size + rows * D + r]);
        for (long d = 0; d < D; d++) o[d] = 0.f;
        for (long g = 0; g < nseg; g++) {
            const float *p = part + g * size;
            if (p[rows * D + r] == -INFINITY) continue;   /* a part past the row's last key */
            float c = expf(p[rows * D + r] - top);
            total += c * p[rows * D + rows + r];
            for (long d = 0; d < D; d++) o[d] += c * p[r * D + d];
        }
        float inv = 1.f / total;
        for (long d = 0; d < D; d++) o[d] *= inv;
        if (act_bf16)
            store_bf16((bf16 *)pb->out + row0 + r * D, o, D);
        else
            memcpy((float *)pb->out + row0 + r * D, o, sizeof(float) * D);
    }
}

/* Checks the metadata, then attends every (sequence, query tile, part of its context) of the runs of at
 * most short_max tokens in parallel (longer runs are left to the prefill kernel): with fewer items than
 * threads, every (item, KV head), or a lone short decode would keep one core. Either way each row is
 * computed by the same steps, so the split changes no bits. */
static int paged_attention(const Problem *pb, long B, long T, long num_blocks, int threads, int act_bf16, int kind,
                           long short_max) {
    int bad = check_metadata(pb->block_tables, pb->query_start_loc, pb->seq_lens, B, T, pb->block_size,
                             pb->table_width, num_blocks);
    if (bad) return bad;
    long *tiles = malloc(sizeof(long) * (B + 1));   /* sequence b's tiles are [tiles[b], tiles[b + 1]) */
    if (tiles == NULL) return -1;
    tiles[0] = 0;
    for (long b = 0; b < B; b++) {
        long q_len = pb->query_start_loc[b + 1] - pb->query_start_loc[b];
        tiles[b + 1] = tiles[b] + (pb->seq_lens[b] > 0 && q_len <= short_max ? (q_len + QUERY_TILE - 1) / QUERY_TILE : 0);
    }
    /* Tile t's parts are items [items[t], items[t + 1]); one of several writes its sums at parts + at[t]. */
    long *items = malloc(sizeof(long) * (2 * tiles[B] + 2)), *seq = malloc(sizeof(long) * (tiles[B] + 1));
    if (items == NULL || seq == NULL) {
        free(tiles), free(items), free(seq);
        return -1;
    }
    long *at = items + tiles[B] + 1, floats = 0;
    items[0] = 0;
    for (long b = 0; b < B; b++)
        for (long t = tiles[b]; t < tiles[b + 1]; t++) {
            long q_len = pb->query_start_loc[b + 1] - pb->query_start_loc[b], i0 = (t - tiles[b]) * QUERY_TILE;
            long n = tile_tokens(pb, b, i0), span = pb->seq_lens[b] - q_len + i0 + n;
            long nseg = (span + SEG - 1) / SEG;
            seq[t] = b, items[t + 1] = items[t] + nseg, at[t] = floats;
            if (nseg > 1) floats += nseg * n * pb->Hq * (pb->D + 2);
        }
    float *parts_buf = floats ? malloc(sizeof(float) * floats) : NULL;
    long S = items[tiles[B]], parts = threads > 1 && S < threads ? pb->Hk : 1;   /* KV-head ranges per item */
    int failed = floats && parts_buf == NULL;
#pragma omp parallel num_threads(threads) if (threads > 1 && S * parts > 1)
    {
#pragma omp for schedule(dynamic)
        for (long w = 0; w < S * parts; w++) {
            if (failed) continue;
            long item = w / parts, part = w % parts;
            long lo = 0, hi = tiles[B];   /* the tile holding the item: items[lo] <= item < items[lo + 1] */
            while (hi - lo > 1) {
                long mid = (lo + hi) / 2;
                if (items[mid] <= item) lo = mid; else hi = mid;
            }
            long b = seq[lo], g = item - items[lo], nseg = items[lo + 1] - items[lo];
            long i0 = (lo - tiles[b]) * QUERY_TILE, h0 = part * pb->Hk / parts, h1 = (part + 1) * pb->Hk / parts;
            long rows = tile_tokens(pb, b, i0) * pb->Hq;
            float *out = nseg > 1 ? parts_buf + at[lo] + g * rows * (pb->D + 2) : NULL;
            if (attend_any(pb, b, i0, h0, h1, g * SEG, (g + 1) * SEG, out, act_bf16, kind)) failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (long t = 0; t < tiles[B]; t++)
            if (!failed && items[t + 1] - items[t] > 1)
                merge(pb, seq[t], (t - tiles[seq[t]]) * QUERY_TILE, items[t + 1] - items[t], parts_buf + at[t],
                      act_bf16);
    }
    free(tiles), free(items), free(seq), free(parts_buf);
    return failed ? -1 : 0;
}

/* ---- Long query runs (prefill chunks) ----
 *
 * Scoring a row at a time reads every key once per row; a prefill chunk has hundreds of rows per key.
 * Here a work item is one KV head of up to PR * W rows of one sequence (token, query head of the group;
 * token-major), and the rows lie in the lanes of PR vectors: the item's queries are transposed once
 * into qt[D][rows], so a key's scores for every row are PR fused multiply-adds per element of D, and
 * the softmax's max, exponentials and sums are lane-wise, with no horizontal sum. The context is walked
 * PK keys at a time, each block widened (and, for an int8 or fp8 cache, scaled) into float32 scratch,
 * with flash attention's running max and sum: a block's weights are summed into ot[D][rows], the
 * output kept transposed until the end. A row's arithmetic depends only on its query, the keys it sees
 * and D: the blocks start at multiples of PK from key 0 whichever rows share the item. Where the CPU has
 * AMX, a bf16 cache's items run on its tiles instead (prefill_item_amx).
 */
#define PR 3    /* row vectors per item: 48 rows with AVX-512, 24 with AVX2 */
#define PK 32   /* keys per block of the running softmax */
#ifdef __AVX512F__
#define SK 8    /* keys scored together: SK x PR accumulators */
#define SD 8    /* value columns summed together: SD x PR accumulators */
#else
#define SK 4
#define SD 4
#endif
#define PROWS (PR * W)
#ifdef __AVX512BF16__
#define DOT_BF16 1
#else
#define DOT_BF16 0
#endif

#ifdef __AVX512F__
/* Rows r[0..15] -> columns: r[i] gets lane i of every input, in input order. Three rounds of two-input
 * shuffles (pairs of lanes, then of 4-lane groups, then of 128-bit lanes twice). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88), t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
}
#endif

/* An item's PROWS rows (row r: token t0 + r / group, query head h * group + r % group; lanes past `rows`
 * hold zero queries, their results dropped): its queries transposed, as bf16 pairs (d, d + 1) into
 * qp[D / 2][PROWS] where qp is given, else as float32 into qt[D][PROWS]; each row's last key (limit) and
 * its running max and sum, started. */
static inline void item_rows(const Problem *pb, long t0, long h, long rows, long past, long nt, uint32_t *qp,
                             float *qt, int act_bf16, float *limit, float *run_max, float *run_sum) {
    const long D = pb->D, Hq = pb->Hq, group = Hq / pb->Hk;
    const bf16 *q = pb->q;
#ifdef __AVX512F__
    if (qp && D % 32 == 0) {   /* 16 rows x 16 pairs at a time, each a row's 64 bytes as they lie, transposed */
        for (long r0 = 0; r0 < PROWS; r0 += 16)
            for (long d = 0; d < D; d += 32) {
                __m512 x[16];
                for (long i = 0; i < 16; i++) {
                    long r = r0 + i, row = (t0 + r / group) * Hq + h * group + r % group;
                    x[i] = r < rows ? _mm512_loadu_ps(q + row * D + d) : _mm512_setzero_ps();
                }
                transpose16(x);
                for (long i = 0; i < 16; i++) _mm512_storeu_ps(qp + (d / 2 + i) * PROWS + r0, x[i]);
            }
        qp = NULL, qt = NULL;   /* packed: the loop below only starts each row's limit, max and sum */
    }
#endif
    for (long r = 0; r < PROWS; r++) {
        long row = (t0 + r / group) * Hq + h * group + r % group;
        if (qp)
            for (long d = 0; d < D; d += 2)
                qp[d / 2 * PROWS + r] = r < rows ? q[row * D + d] | (uint32_t)q[row * D + d + 1] << 16 : 0;
        else if (qt)
            for (long d = 0; d < D; d++) qt[d * PROWS + r] = r < rows ? load1(pb->q, row * D + d, act_bf16 ? BF16 : F32) : 0.f;
        limit[r] = (float)(past + (r < rows ? r / group : nt - 1));
        run_max[r] = -INFINITY, run_sum[r] = 0.f;
    }
}

/* The running softmax over one block of keys [t0, t0 + padded), its scores s[key][row] (rows in the lanes of
 * PR vectors, PROWS apart): the sums so far rescaled to the new max, the block's weights e^(s - max) written
 * over the scores (0 where masked) and added. Every row sees key 0, so its max is finite from the first
 * block on. rescale gets e^(old max - new max) for each row, by which the sums of values shrink. */
static inline void block_softmax(float *s, long padded, long t0, const vec *lim, int masked, const vec *block_max,
                                 float *run_max, float *run_sum, vec *rescale) {
    vec new_max[PR], sum[PR];
    for (int p = 0; p < PR; p++) {
        vec old = vloadf(run_max + p * W);
        new_max[p] = vmax(old, block_max[p]);
        rescale[p] = vexp(vsub(old, new_max[p]));
        sum[p] = vzero();
    }
    for (long j = 0; j < padded; j++)
        for (int p = 0; p < PR; p++) {
            vec e = vexp(vsub(vloadf(s + j * PROWS + p * W), new_max[p]));
            if (masked) e = vwhere_le(vset1((float)(t0 + j)), lim[p], e, vzero());
            sum[p] = vadd(sum[p], e);
            vstoref(s + j * PROWS + p * W, e);
        }
    for (int p = 0; p < PR; p++) {
        vstoref(run_sum + p * W, vadd(vmul(vloadf(run_sum + p * W), rescale[p]), sum[p]));
        vstoref(run_max + p * W, new_max[p]);
    }
}

/* Tokens [i0, i0 + nt) of sequence b, KV head h: 0, or -1 when its scratch cannot be had. */
static inline __attribute__((always_inline)) int prefill_item(const Problem *pb, long b, long i0, long nt, long h,
                                                              int act_bf16, int kind) {
    const long D = pb->D, Hq = pb->Hq, group = Hq / pb->Hk, block_size = pb->block_size;
    const long first = pb->query_start_loc[b], q_len = pb->query_start_loc[b + 1] - first;
    const long past = pb->seq_lens[b] - q_len + i0, span = past + nt, rows = nt * group;   /* row r: key <= past + r / group */
    const long slot_stride = pb->Hk * D;
    const int *table = pb->block_tables + b * pb->table_width;
    float *scratch = aligned_alloc(64, sizeof(float) * (2 * D * PROWS + PK * PROWS + 2 * PK * D + 3 * PROWS));
    if (scratch == NULL) return -1;
    float *qt = scratch, *ot = qt + D * PROWS, *s = ot + D * PROWS, *kf = s + PK * PROWS, *vf = kf + PK * D;
    float *limit = vf + PK * D, *run_max = limit + PROWS, *run_sum = run_max + PROWS;
    /* A bf16 cache's scores by dpbf16 where the CPU has it: qt then holds the queries' bf16 pairs
     * (d, d + 1) as uint32 [D / 2][rows], and each key's pairs are broadcast from the cache as they lie,
     * two products an instruction and no widening (kf unused); the sum is scaled once. */
    const int dot_bf16 = DOT_BF16 && kind == BF16;
    uint32_t *qp = (uint32_t *)qt;
    long kat[PK];   /* with dot_bf16: where each key of a block starts in the cache (padding: the block's first) */
    item_rows(pb, first + i0, h, rows, past, nt, dot_bf16 ? qp : NULL, qt, act_bf16, limit, run_max, run_sum);
    memset(ot, 0, sizeof(float) * D * PROWS);
    for (long t0 = 0; t0 < span; t0 += PK) {
        const long n = span - t0 < PK ? span - t0 : PK, padded = (n + SK - 1) / SK * SK;
        /* The block's keys (times the softmax scale) and values in float32; keys past the span are zeros,
         * masked below like any key a row does not see. */
        for (long j = 0; j < padded; j++) {
            if (j >= n) {
                kat[j] = kat[0];
                memset(kf + j * D, 0, sizeof(float) * D), memset(vf + j * D, 0, sizeof(float) * D);
                continue;
            }
            long t = t0 + j, at = ((long)table[t / block_size] * block_size + t % block_size) * slot_stride + h * D;
            float ks = pb->scale, vs = 1.f;
            if (kind >= I8) {
                long scale_at = (long)table[t / block_size] * pb->Hk + h;
                ks *= pb->k_scales[scale_at], vs = pb->v_scales[scale_at];
            }
            kat[j] = at;
            long d = 0;
            for (; d + W <= D; d += W) {
                if (!dot_bf16) vstoref(kf + j * D + d, vmul(vload(pb->k_cache, at + d, kind), vset1(ks)));
                vstoref(vf + j * D + d, vmul(vload(pb->v_cache, at + d, kind), vset1(vs)));
            }
            for (; d < D; d++) {
                if (!dot_bf16) kf[j * D + d] = load1(pb->k_cache, at + d, kind) * ks;
                vf[j * D + d] = load1(pb->v_cache, at + d, kind) * vs;
            }
        }
        const int masked = t0 + padded - 1 > past;   /* some row does not see some key of the block */
        vec lim[PR], block_max[PR];
        for (int p = 0; p < PR; p++) lim[p] = vloadf(limit + p * W), block_max[p] = vset1(-INFINITY);
        for (long j0 = 0; j0 < padded; j0 += SK) {   /* scores: SK keys x PR row vectors in registers */
            vec acc[SK][PR];
            for (int j = 0; j < SK; j++)
                for (int p = 0; p < PR; p++) acc[j][p] = vzero();
#ifdef __AVX512BF16__
            if (dot_bf16) {
                for (long d = 0; d < D; d += 2) {
                    __m512bh qv[PR];
                    for (int p = 0; p < PR; p++) qv[p] = (__m512bh)_mm512_loadu_si512(qp + d / 2 * PROWS + p * W);
                    for (int j = 0; j < SK; j++) {
                        uint32_t pair;
                        memcpy(&pair, (const bf16 *)pb->k_cache + kat[j0 + j] + d, sizeof(pair));
                        __m512bh kv = (__m512bh)_mm512_set1_epi32((int)pair);
                        for (int p = 0; p < PR; p++) acc[j][p] = _mm512_dpbf16_ps(acc[j][p], qv[p], kv);
                    }
                }
                for (int j = 0; j < SK; j++)
                    for (int p = 0; p < PR; p++) acc[j][p] = vmul(acc[j][p], vset1(pb->scale));
            } else
#endif
            for (long d = 0; d < D; d++) {
                vec qv[PR];
                for (int p = 0; p < PR; p++) qv[p] = vloadf(qt + d * PROWS + p * W);
                for (int j = 0; j < SK; j++) {
                    vec kv = vset1(kf[(j0 + j) * D + d]);
                    for (int p = 0; p < PR; p++) acc[j][p] = vfma(kv, qv[p], acc[j][p]);
                }
            }
            for (int j = 0; j < SK; j++)
                for (int p = 0; p < PR; p++) {
                    vec a = masked ? vwhere_le(vset1((float)(t0 + j0 + j)), lim[p], acc[j][p], vset1(-INFINITY))
                                   : acc[j][p];
                    block_max[p] = vmax(block_max[p], a);
                    vstoref(s + (j0 + j) * PROWS + p * W, a);
                }
        }
        vec rescale[PR];
        block_softmax(s, padded, t0, lim, masked, block_max, run_max, run_sum, rescale);
        for (long d0 = 0; d0 < D; d0 += SD) {   /* ot[d] = ot[d] * rescale + sum over keys of weight x value[d] */
            vec acc[SD][PR];
            for (int c = 0; c < SD; c++)
                for (int p = 0; p < PR; p++) acc[c][p] = vmul(vloadf(ot + (d0 + c) * PROWS + p * W), rescale[p]);
            for (long j = 0; j < padded; j++) {
                vec w[PR];
                for (int p = 0; p < PR; p++) w[p] = vloadf(s + j * PROWS + p * W);
                for (int c = 0; c < SD; c++) {
                    vec v = vset1(vf[j * D + d0 + c]);
                    for (int p = 0; p < PR; p++) acc[c][p] = vfma(v, w[p], acc[c][p]);
                }
            }
            for (int c = 0; c < SD; c++)
                for (int p = 0; p < PR; p++) vstoref(ot + (d0 + c) * PROWS + p * W, acc[c][p]);
        }
    }
    vec inv[PR];   /* divided by the sums, in place */
    for (int p = 0; p < PR; p++) inv[p] = vdiv(vset1(1.f), vloadf(run_sum + p * W));
    for (long d = 0; d < D; d++)
        for (int p = 0; p < PR; p++) vstoref(ot + d * PROWS + p * W, vmul(vloadf(ot + d * PROWS + p * W), inv[p]));
    for (long r = 0; r < rows; r++) {   /* transposed back into the token's rows */
        long row = ((first + i0 + r / group) * Hq + h * group + r % group) * D;
        float *o = act_bf16 ? kf : (float *)pb->out + row;   /* kf: free now, a row of float32 to round */
        for (long d = 0; d < D; d++) o[d] = ot[d * PROWS + r];
        if (act_bf16) store_bf16((bf16 *)pb->out + row, o, D);
    }
    free(scratch);
    return 0;
}

#ifdef AMX_BF16
#define AK 32   /* keys per block here: one bf16 A tile row of weights, the K of one product */

/* prefill_item for a bf16 cache on AMX's tiles (D a multiple of 32, PR row vectors of 16 in three C tiles).
 * A block of AK keys is gathered from the cache: K as it lies (the A tile of the scores: S^T = K Q^T, keys
 * in rows and the item's rows in the lanes, so the running softmax above runs unchanged on it) and V with
 * consecutive keys' values interleaved, the pair layout of a B tile. The weights are transposed to rows and
 * split into a bf16 part and the bf16 rounding of what it leaves (P = hi + lo to ~2^-16), so the values'
 * sums keep float32 precision where one bf16 operand would round every weight; both multiply V in float32
 * tiles. The output rows o[row][D] take each block's sums as out = out * rescale + block. */
static int prefill_item_amx(const Problem *pb, long b, long i0, long nt, long h) {
    const long D = pb->D, Hq = pb->Hq, group = Hq / pb->Hk, block_size = pb->block_size;
    const long first = pb->query_start_loc[b], q_len = pb->query_start_loc[b + 1] - first;
    const long past = pb->seq_lens[b] - q_len + i0, span = past + nt, rows = nt * group;
    const long slot_stride = pb->Hk * D;
    const int *table = pb->block_tables + b * pb->table_width;
    const bf16 *kc = pb->k_cache, *vc = pb->v_cache;
    /* qp [D / 2][PROWS] query pairs (the scores' B tiles), o [PROWS][D], s [AK][PROWS], pv [16][D], kb [AK][D],
     * vb [AK / 2][D][2], ph and pl [PR][16][AK] bf16, limit, run_max, run_sum, rescale [PROWS] */
    float *scratch = aligned_alloc(64, sizeof(float) * (D / 2 * PROWS + PROWS * D + AK * PROWS + 16 * D + AK * D +
                                                        PR * 16 * AK + 4 * PROWS));
    if (scratch == NULL) return -1;
    uint32_t *qp = (uint32_t *)scratch;
    float *o = scratch + D / 2 * PROWS, *s = o + PROWS * D, *pv = s + AK * PROWS;
    bf16 *kb = (bf16 *)(pv + 16 * D), *vb = kb + AK * D, *ph = vb + AK * D, *pl = ph + PR * 16 * AK;
    float *limit = (float *)(pl + PR * 16 * AK), *run_max = limit + PROWS, *run_sum = run_max + PROWS;
    float *resc = run_sum + PROWS;
    item_rows(pb, first + i0, h, rows, past, nt, qp, NULL, 1, limit, run_max, run_sum);
    memset(o, 0, sizeof(float) * PROWS * D);
    const __m512i even_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                              39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i odd_idx = _mm512_add_epi16(even_idx, _mm512_set1_epi16(16));
    configure_tiles();
    for (long t0 = 0; t0 < span; t0 += AK) {
        const long n = span - t0 < AK ? span - t0 : AK;
        /* The block's keys and values; keys past the span are zeros, masked below like any key a row does not see. */
        for (long j = 0; j < AK; j += 2) {
            const bf16 *v2[2];
            for (int x = 0; x < 2; x++) {
                long t = t0 + j + x;
                if (t < t0 + n) {
                    long at = ((long)table[t / block_size] * block_size + t % block_size) * slot_stride + h * D;
                    memcpy(kb + (j + x) * D, kc + at, sizeof(bf16) * D);
                    v2[x] = vc + at;
                } else {
                    memset(kb + (j + x) * D, 0, sizeof(bf16) * D);
                    v2[x] = NULL;
                }
            }
            for (long d = 0; d < D; d += 32) {   /* keys j and j + 1 interleaved: B row j / 2 */
                __m512i a = v2[0] ? _mm512_loadu_si512(v2[0] + d) : _mm512_setzero_si512();
                __m512i c = v2[1] ? _mm512_loadu_si512(v2[1] + d) : _mm512_setzero_si512();
                _mm512_storeu_si512(vb + j * D + 2 * d, _mm512_permutex2var_epi16(a, even_idx, c));
                _mm512_storeu_si512(vb + j * D + 2 * d + 32, _mm512_permutex2var_epi16(a, odd_idx, c));
            }
        }
        for (long kt = 0; kt < AK; kt += 16) {   /* S^T: 16 keys x 16 rows a tile, the three row tiles at once */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            for (long d = 0; d < D; d += 32) {
                _tile_loadd(3, kb + kt * D + d, D * sizeof(bf16));
                _tile_loadd(4, qp + d / 2 * PROWS, PROWS * sizeof(uint32_t));
                _tile_dpbf16ps(0, 3, 4);
                _tile_loadd(4, qp + d / 2 * PROWS + 16, PROWS * sizeof(uint32_t));
                _tile_dpbf16ps(1, 3, 4);
                _tile_loadd(4, qp + d / 2 * PROWS + 32, PROWS * sizeof(uint32_t));
                _tile_dpbf16ps(2, 3, 4);
            }
            _tile_stored(0, s + kt * PROWS, PROWS * sizeof(float));
            _tile_stored(1, s + kt * PROWS + 16, PROWS * sizeof(float));
            _tile_stored(2, s + kt * PROWS + 32, PROWS * sizeof(float));
        }
        const int masked = t0 + AK - 1 > past;
        vec lim[PR], block_max[PR], rescale[PR];
        for (int p = 0; p < PR; p++) lim[p] = vloadf(limit + p * W), block_max[p] = vset1(-INFINITY);
        for (long j = 0; j < AK; j++)
            for (int p = 0; p < PR; p++) {
                vec a = vmul(vloadf(s + j * PROWS + p * W), vset1(pb->scale));
                if (masked) a = vwhere_le(vset1((float)(t0 + j)), lim[p], a, vset1(-INFINITY));
                block_max[p] = vmax(block_max[p], a);
                vstoref(s + j * PROWS + p * W, a);
            }
        block_softmax(s, AK, t0, lim, masked, block_max, run_max, run_sum, rescale);
        for (int p = 0; p < PR; p++) {   /* the weights as A tiles: rows of 32 keys, hi and lo */
            vstoref(resc + p * W, rescale[p]);
            __m512 c0[16], c1[16];
            for (int j = 0; j < 16; j++) c0[j] = vloadf(s + j * PROWS + p * W), c1[j] = vloadf(s + (16 + j) * PROWS + p * W);
            transpose16(c0);
            transpose16(c1);
            for (int r = 0; r < 16; r++) {
                __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(c1[r], c0[r]);
                __m512 h0 = bf16x16_to_f32(_mm512_castsi512_si256(hi)), h1 = bf16x16_to_f32(_mm512_extracti64x4_epi64(hi, 1));
                _mm512_storeu_si512(ph + (p * 16 + r) * AK, hi);
                _mm512_storeu_si512(pl + (p * 16 + r) * AK, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(c1[r], h1), _mm512_sub_ps(c0[r], h0)));
            }
        }
        for (int p = 0; p < PR; p++) {   /* the block's weighted values, 16 rows x 16 columns a tile */
            _tile_loadd(4, ph + p * 16 * AK, AK * sizeof(bf16));
            _tile_loadd(5, pl + p * 16 * AK, AK * sizeof(bf16));
            /* Two column tiles at a time, their products interleaved: each tile's hi and lo products depend on
             * each other, and one tile at a time left the tile unit waiting on that chain (18% of this kernel). */
            for (long d = 0; d < D; d += 32) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_loadd(6, vb + 2 * d, 2 * D * sizeof(bf16));
                _tile_loadd(7, vb + 2 * (d + 16), 2 * D * sizeof(bf16));
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(0, 5, 6);
                _tile_dpbf16ps(1, 5, 7);
                _tile_stored(0, pv + d, D * sizeof(float));
                _tile_stored(1, pv + d + 16, D * sizeof(float));
            }
            for (int r = 0; r < 16; r++) {
                vec c = vset1(resc[p * W + r]);
                float *orow = o + (p * W + r) * D;
                for (long d = 0; d < D; d += W) vstoref(orow + d, vfma(vloadf(orow + d), c, vloadf(pv + r * D + d)));
            }
        }
    }
    _tile_release();
    for (long r = 0; r < rows; r++) {   /* divided by the sums, rounded into the token's rows */
        long row = ((first + i0 + r / group) * Hq + h * group + r % group) * D;
        vec inv = vdiv(vset1(1.f), vset1(run_sum[r]));
        for (long d = 0; d < D; d += W) vstoref(o + r * D + d, vmul(vloadf(o + r * D + d), inv));
        store_bf16((bf16 *)pb->out + row, o + r * D, D);
    }
    free(scratch);
    return 0;
}
#endif

static int prefill_item_any(const Problem *pb, long b, long i0, long nt, long h, int act_bf16, int kind) {
#ifdef AMX_BF16
    if (act_bf16 && kind == BF16 && pb->D % 32 == 0 && amx_permitted()) return prefill_item_amx(pb, b, i0, nt, h);
#endif
#define PREFILL_ITEM(a, k) prefill_item(pb, b, i0, nt, h, a, k)
    EACH_KIND(act_bf16, kind, PREFILL_ITEM)
#undef PREFILL_ITEM
}

/* The long runs: sequences seqs[0, S) of the batch (its metadata as paged_attention's), every run's
 * tokens cut into items of PROWS / group tokens per KV head, attended in parallel. Returns 0; -1 when
 * out of memory; -2 or -3 as check_metadata; -4 for a shape it does not take (D not a multiple of
 * SD, a group wider than PROWS, a sequence index out of range). */
static int prefill(const Problem *pb, const int *seqs, long S, long B, long T, long num_blocks, int threads,
                   int act_bf16, int kind) {
    int bad = check_metadata(pb->block_tables, pb->query_start_loc, pb->seq_lens, B, T, pb->block_size,
                             pb->table_width, num_blocks);
    if (bad) return bad;
    long group = pb->Hk > 0 && pb->Hq % pb->Hk == 0 ? pb->Hq / pb->Hk : 0;
    if (group < 1 || group > PROWS || pb->D % SD != 0 || pb->D <= 0) return -4;
    long per = PROWS / group;   /* tokens per item */
    long *items = malloc(sizeof(long) * (S + 1));   /* seqs[x]'s items are [items[x], items[x + 1]) */
    if (items == NULL) return -1;
    items[0] = 0;
    for (long x = 0; x < S; x++) {
        if (seqs[x] < 0 || seqs[x] >= B) {
            free(items);
            return -4;
        }
        long q_len = pb->query_start_loc[seqs[x] + 1] - pb->query_start_loc[seqs[x]];
        items[x + 1] = items[x] + (q_len + per - 1) / per * pb->Hk;
    }
    int failed = 0;
    /* Last items first: a run's later tokens see more keys, so its items grow along it, and the threads taking
     * the largest first finish together (in order, the last large item kept one thread while the other waited). */
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && items[S] > 1)
    for (long v = 0; v < items[S]; v++) {
        long w = items[S] - 1 - v, lo = 0, hi = S;   /* the sequence holding item w: items[lo] <= w < items[lo + 1] */
        while (hi - lo > 1) {
            long mid = (lo + hi) / 2;
            if (items[mid] <= w) lo = mid; else hi = mid;
        }
        long b = seqs[lo], k = w - items[lo], i0 = k / pb->Hk * per, h = k % pb->Hk;
        long q_len = pb->query_start_loc[b + 1] - pb->query_start_loc[b];
        if (prefill_item_any(pb, b, i0, q_len - i0 < per ? q_len - i0 : per, h, act_bf16, kind)) failed = 1;
    }
    free(items);
    return failed ? -1 : 0;
}

/* A batch of short runs (decodes, verifications: at most short_max tokens, the decode kernel) and long ones
 * (prefill chunks, the prefill kernel) in one call: each row as the kernel of its run computes it alone,
 * into rows of out the other kernel does not touch. The long runs go first, so the prefill kernel's own
 * checks (metadata, its shapes) come before anything is computed. Returns 0; -1 when out of memory; -2,
 * -3 as check_metadata; -4 for a long run's shape the prefill kernel does not take. */
static int mixed_attention(const Problem *pb, long B, long T, long num_blocks, int threads, int act_bf16, int kind,
                           long short_max) {
    int *seqs = malloc(sizeof(int) * (B + 1)), status = 0;
    if (seqs == NULL) return -1;
    long S = 0;
    for (long b = 0; b < B; b++)
        if ((long)pb->query_start_loc[b + 1] - pb->query_start_loc[b] > short_max) seqs[S++] = (int)b;
    if (S > 0) status = prefill(pb, seqs, S, B, T, num_blocks, threads, act_bf16, kind);
    if (status == 0) status = paged_attention(pb, B, T, num_blocks, threads, act_bf16, kind, short_max);
    free(seqs);
    return status;
}

/* q, out: [T, Hq, D], in bfloat16 when act_bf16, else float32; caches: [num_blocks, block_size, Hk, D] of
 * `cache_kind` (0 float32, 1 bfloat16, 2 int8, 3 fp8 e4m3; for the last two, k_scales and v_scales
 * [num_blocks, Hk], else NULL); block_tables: [B, table_width]; query_start_loc: [B + 1]; seq_lens: [B]. Runs
 * of at most short_max tokens (decodes, verifications) go through the decode kernel, longer ones (prefill
 * chunks) through the prefill kernel. Returns 0; -1 when a scratch buffer cannot be had; -2 or -3 for
 * inconsistent metadata (see check_metadata), -4 for a dtype pair or a long run's shape the kernels do not
 * take, before anything is read through it. */
int matinee_paged_attention(const void *q, const void *k_cache, const void *v_cache, const float *k_scales,
                            const float *v_scales, const int *block_tables, const int *query_start_loc,
                            const int *seq_lens, void *out, long B, long T, long Hq, long Hk, long D, long block_size,
                            long table_width, long num_blocks, float scale, int threads, int act_bf16,
                            int cache_kind, long short_max) {
    if (cache_kind < F32 || cache_kind > FP8 || (cache_kind == BF16) != (act_bf16 != 0 && cache_kind < I8)) return -4;
    if (cache_kind >= I8 && (k_scales == NULL || v_scales == NULL)) return -4;
    Problem pb = {q, k_cache, v_cache, k_scales, v_scales, block_tables, query_start_loc, seq_lens, out, Hq, Hk, D,
                  block_size, table_width, scale};
    return mixed_attention(&pb, B, T, num_blocks, threads, act_bf16 != 0, cache_kind, short_max);
}
