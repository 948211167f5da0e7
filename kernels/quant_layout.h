/* The packed GGUF weight as quant_linear.py lays it out for the CPU kernels (quant_gemm.c multiplies it,
 * quant_widen.c widens it to bfloat16): 16 output rows of one block of 32 values (one super-block of 256
 * for a K-quant) per group, ggml's type numbers, and a group's bytes. */
#ifndef MATINEE_QUANT_LAYOUT_H
#define MATINEE_QUANT_LAYOUT_H

#define QK 32
#define GR 16
#define Q4_0 2                      /* ggml's type numbers */
#define Q4_1 3
#define Q5_0 6
#define Q5_1 7
#define Q8_0 8
#define Q4_K 12
#define Q5_K 13
#define Q6_K 14
#define BF16P 30                    /* not GGUF's: packed_linear.py's bf16 layout (ggml's number for bf16), which
                                       quant_amx.c takes too */
#define QKK 256                     /* values per K-quant super-block: 8 blocks of x */

static inline int is_k(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

/* Bytes of one group: 16 rows of one block (32 values), or of one super-block (256) for a K-quant. */
static inline long group_bytes(int type) {
    switch (type) {
    case Q8_0: return 2 * GR + GR * QK;
    case Q4_0: return 2 * GR + GR * QK / 2;
    case Q4_1: return 4 * GR + GR * QK / 2;
    case Q5_0: return 2 * GR + GR * (4 + QK / 2);
    case Q5_1: return 4 * GR + GR * (4 + QK / 2);
    case Q4_K: return GR * 148;   /* d, dmin, 8 scales, 8 mins, 128 bytes of nibbles */
    case Q5_K: return GR * 180;   /* and 32 of fifth bits */
    default: return GR * 210;     /* Q6_K: d, 16 scales, 128 of nibbles, 64 of high pairs */
    }
}
#endif
