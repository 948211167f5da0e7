/* The structured output's token mask on the CPU: a logits row gets -inf at every token its grammar
 * refuses. The bitmask is xgrammar's: 32 tokens a word, bit t % 32 of word t / 32 set when token t
 * is allowed. One pass over the row, a word at a time: a word of all-allowed tokens costs a compare, any other
 * two masked 16-lane stores (AVX-512) or four 8-lane ones (AVX2), with no branch per token: inside a
 * string the refused tokens (those with a quote or a control character) are scattered over most words. xgrammar's own CPU apply visits every token through its bits,
 * which costs 3-7 ms a step for 16 rows over a 49k vocabulary; this loop stays under the time of
 * writing the refused floats. Built by cpu_native.py. */
#include <immintrin.h>
#include <stdint.h>

/* Stores -inf at the refused lanes of one word's 32 floats, without a branch per token. */
static inline void refuse_word(float *base, uint32_t refused) {
#if defined(__AVX512F__)
    const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
    _mm512_mask_storeu_ps(base, (__mmask16)(refused & 0xFFFFu), neg_inf);
    _mm512_mask_storeu_ps(base + 16, (__mmask16)(refused >> 16), neg_inf);
#else   /* AVX2: each lane tests its own bit of the word */
    const __m256 neg_inf = _mm256_set1_ps(-__builtin_inff());
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int j = 0; j < 4; j++) {
        __m256i word = _mm256_set1_epi32((int32_t)(refused >> (8 * j)));
        __m256i lanes = _mm256_cmpeq_epi32(_mm256_and_si256(word, lane_bit), lane_bit);
        _mm256_maskstore_ps(base + 8 * j, lanes, neg_inf);
    }
#endif
}

/* logits [rows of `stride` floats], `vocab` of each masked; bitmask [rows of `words` int32];
 * `row_ids[i]` the logits row and bitmask row masked (the others are untouched). */
void matinee_apply_token_bitmask(float *logits, long stride, long vocab, const int32_t *bitmask, long words,
                                 const long *row_ids, long num_rows) {
    for (long i = 0; i < num_rows; i++) {
        float *row = logits + row_ids[i] * stride;
        const uint32_t *bits = (const uint32_t *)(bitmask + row_ids[i] * words);
        long full_words = vocab / 32;
        for (long w = 0; w < full_words; w++) {
            uint32_t refused = ~bits[w];
            if (refused == 0)
                continue;
            if (__builtin_popcount(refused) > 4) {
                refuse_word(row + w * 32, refused);
                continue;
            }
            do {   /* a few refused tokens among allowed ones: a store each */
                row[w * 32 + __builtin_ctz(refused)] = -__builtin_inff();
                refused &= refused - 1;
            } while (refused);
        }
        for (long t = full_words * 32; t < vocab; t++)   /* the last, partial word */
            if (!((bits[t / 32] >> (t % 32)) & 1u))
                row[t] = -__builtin_inff();
    }
}
