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
#define IQ4_NL 20                   /* Q4_0's block, its nibbles indexing kvalues_iq4nl (IQ4_LEVELS) */
#define IQ4_XS 23                   /* a super-block of 256: 8 signed 6-bit scales, IQ4_NL's nibbles */
#define BF16P 30                    /* not GGUF's: packed_linear.py's bf16 layout (ggml's number for bf16), which
                                       quant_amx.c takes too */
#define QKK 256                     /* values per K-quant super-block: 8 blocks of x */

/* The types whose group is a super-block of 256 (x quantized per 256, kquant.py's layouts). */
static inline int is_k(int type) { return type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS; }

/* The 16 values an IQ4 nibble stands for (ggml's kvalues_iq4nl), signed bytes. */
#define IQ4_LEVELS {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}

/* Bytes of one group: 16 rows of one block (32 values), or of one super-block (256) for a K-quant. */
static inline long group_bytes(int type) {
    switch (type) {
    case Q8_0: return 2 * GR + GR * QK;
    case Q4_0: case IQ4_NL: return 2 * GR + GR * QK / 2;
    case Q4_1: return 4 * GR + GR * QK / 2;
    case Q5_0: return 2 * GR + GR * (4 + QK / 2);
    case Q5_1: return 4 * GR + GR * (4 + QK / 2);
    case Q4_K: return GR * 148;   /* d, dmin, 8 scales, 8 mins, 128 bytes of nibbles */
    case Q5_K: return GR * 180;   /* and 32 of fifth bits */
    case IQ4_XS: return GR * 138; /* d, 8 scales (less 32, int8), 128 bytes of nibbles */
    default: return GR * 210;     /* Q6_K: d, 16 scales, 128 of nibbles, 64 of high pairs */
    }
}
#endif
