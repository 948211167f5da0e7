/* Paged attention for short query runs (decode tokens, speculative verification) on the CPU.
 *
 * Each sequence reads its keys and values in place through the block table: no
 * gathered copy of the context, no padding to the batch's longest sequence. Every query row is
 * computed alone (scores, max, exp, sum, weighted values), so a row's result never depends on
 * the rest of the batch. Query row i of a sequence with q_len new tokens and seq_len tokens in all
 * sees keys [0, seq_len - q_len + i]. Built by cpu_native.py; the reference is paged_attention.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

/* o += w * v over n floats. */
static inline void axpy(float *restrict o, const float *restrict v, float w, long n) {
    __m256 wv = _mm256_set1_ps(w);
    long n8 = n & ~7L;
    for (long i = 0; i < n8; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
    for (long i = n8; i < n; i++) o[i] += w * v[i];
}

/* Scores of up to 4 query rows against one key: the key is read once, and the rows' sums are
 * independent chains. Each row is summed in the same order as dot() would, so a row's result does
 * not depend on which rows share its group. */
static inline void dot4(const float *const *qs, int n, const float *key, long D, float *s) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long d8 = D & ~7L;
    for (long d = 0; d < d8; d += 8) {
        __m256 k = _mm256_loadu_ps(key + d);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[0] + d), k, a0);
        if (n > 1) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[1] + d), k, a1);
        if (n > 2) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[2] + d), k, a2);
        if (n > 3) a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[3] + d), k, a3);
    }
    __m256 acc[4] = {a0, a1, a2, a3};
    for (int r = 0; r < n; r++) {
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        x = _mm_add_ss(x, _mm_movehdup_ps(x));
        float total = _mm_cvtss_f32(x);
        for (long d = d8; d < D; d++) total += qs[r][d] * key[d];
        s[r] = total;
    }
}

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

/* q, out: [T, Hq, D]; caches: [num_blocks, block_size, Hk, D]; block_tables: [B, table_width];
 * query_start_loc: [B + 1]; seq_lens: [B]. Returns 0; -1 when a scratch buffer cannot be had; -2 or
 * -3 for inconsistent metadata (see check_metadata), before anything is read through it.
 *
 * One sequence at a time. Its rows are (new token, query head), token-major. A slot's keys for
 * every KV head lie side by side, so the sequence's keys, then its values, are read as one
 * stream; each key serves every row that sees it. (Walking one KV head's keys at a time instead
 * measured twice slower: 256 of every 768 bytes, a stride the prefetcher serves badly.) */
int matinee_paged_attention(const float *q, const float *k_cache, const float *v_cache, const int *block_tables,
                            const int *query_start_loc, const int *seq_lens, float *out, long B, long T,
                            long Hq, long Hk, long D, long block_size, long table_width, long num_blocks,
                            float scale, int threads) {
    int bad = check_metadata(block_tables, query_start_loc, seq_lens, B, T, block_size, table_width, num_blocks);
    if (bad) return bad;
    long group = Hq / Hk;
    long slot_stride = Hk * D;                /* floats between consecutive slots of one block */
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1)
    for (long b = 0; b < B; b++) {
        long seq_len = seq_lens[b];
        long first = query_start_loc[b], q_len = query_start_loc[b + 1] - first;
        long rows = q_len * Hq;
        if (rows <= 0 || seq_len <= 0) continue;
        const int *table = block_tables + b * table_width;
        float *p = malloc(sizeof(float) * rows * seq_len);
        long *slot = malloc(sizeof(long) * seq_len);
        if (p == NULL || slot == NULL) {
            failed = 1;
            free(p), free(slot);
            continue;
        }
        /* Slot t's row (every KV head) starts at slot[t] in either cache: the table is walked a block
         * at a time, with no division per token, once for both passes. */
        for (long t0 = 0, t = 0; t0 < seq_len; t0 += block_size) {
            long base = (long)table[t0 / block_size] * block_size;
            for (long j = 0; j < block_size && t < seq_len; j++, t++) slot[t] = (base + j) * slot_stride;
        }
        /* Row r = token * Hq + head: q and out rows are consecutive in memory. */
        const float *qb = q + first * Hq * D;
        float *ob = out + first * Hq * D;
        for (long i = 0; i < rows * D; i++) ob[i] = 0.f;
        /* New token i (0-based) sees keys [0, past + i]; key t is seen by tokens from t - past on. */
        long past = seq_len - q_len;
        for (long t = 0; t < seq_len; t++) {
            for (long i = t > past ? t - past : 0; i < q_len; i++)
                for (long h = 0; h < Hk; h++) {
                    const float *key = k_cache + slot[t] + h * D;
                    const float *qs[4];
                    float s[4];
                    for (long g0 = 0; g0 < group; g0 += 4) {
                        int m = group - g0 < 4 ? (int)(group - g0) : 4;
                        for (int x = 0; x < m; x++) qs[x] = qb + (i * Hq + h * group + g0 + x) * D;
                        dot4(qs, m, key, D, s);
                        for (int x = 0; x < m; x++) p[(i * Hq + h * group + g0 + x) * seq_len + t] = s[x] * scale;
                    }
                }
        }
        for (long r = 0; r < rows; r++) {
            long visible = past + r / Hq + 1;
            float *pr = p + r * seq_len, max = -INFINITY, sum = 0.f;
            for (long t = 0; t < visible; t++) max = pr[t] > max ? pr[t] : max;
            for (long t = 0; t < visible; t++) {
                pr[t] = expf(pr[t] - max);
                sum += pr[t];
            }
            float inv = 1.f / sum;
            for (long t = 0; t < visible; t++) pr[t] *= inv;
        }
        for (long t = 0; t < seq_len; t++)
            for (long i = t > past ? t - past : 0; i < q_len; i++)
                for (long head = 0; head < Hq; head++) {
                    long r = i * Hq + head;
                    axpy(ob + r * D, v_cache + slot[t] + (head / group) * D, p[r * seq_len + t], D);
                }
        free(slot);
        free(p);
    }
    return failed ? -1 : 0;
}
