/* A step's decoder layers in one call: the same kernels, in the same order, with the same arguments as
 * model.py's layer loop runs them through the ops table, so the bits are the same.
 *
 * At one row a SmolLM2 forward spent as long in Python between its 302 kernel calls (checks, views,
 * allocations, ctypes) as in the kernels themselves: 3 ms of a 6 ms step. Here a layer is a struct
 * of pointers to its weights, laid out once at load (decode_layers.py); a step passes the layers,
 * its metadata and the caches, and the loop over layers runs in C. Decodes and verifications come here,
 * and so do prefill chunks beside them (one attention call takes both, each run in its kernel): a short
 * prompt prefilled beside a decode engine's streams would otherwise pay the Python loop in a step that
 * is already its streams' longest gap.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "quant_layout.h"

/* The kernels of the other sources of the library. */
int matinee_quant_gemm(const void *x, int x_bf16, int type, const uint8_t *w, const float *bias, void *y,
                       int y_bf16, long M, long N, long K, int threads);
int matinee_quant_amx(const uint16_t *x, int type, const uint8_t *w, const float *bias, uint16_t *y, long M, long N,
                      long K, int threads);
int matinee_packed_gemm(const void *x, int x_bf16, const uint16_t *w, int w_half, const float *bias, void *y,
                        int y_bf16, long M, long N, long K, int threads, int dot);
void matinee_rms_norm_f32(const void *x, const void *residual, void *residual_out, const void *weight, void *out,
                          long rows, long H, float eps, int threads);
void matinee_rms_norm_bf16(const void *x, const void *residual, void *residual_out, const void *weight, void *out,
                           long rows, long H, float eps, int threads);
int matinee_rope_f32(const long *positions, void *q, void *k, const float *cos_sin, long rows, long Hq, long Hk,
                     long D, long q_stride, long k_stride, long max_pos, int threads);
int matinee_rope_bf16(const long *positions, void *q, void *k, const float *cos_sin, long rows, long Hq, long Hk,
                      long D, long q_stride, long k_stride, long max_pos, int threads);
int matinee_write_kv_f32(const void *k, const void *v, void *k_cache, void *v_cache, const long *slots, long rows,
                         long W, long k_stride, long v_stride, long num_slots, int threads);
int matinee_write_kv_bf16(const void *k, const void *v, void *k_cache, void *v_cache, const long *slots, long rows,
                          long W, long k_stride, long v_stride, long num_slots, int threads);
int matinee_write_kv_quant_f32(const void *k, const void *v, uint8_t *k_cache, uint8_t *v_cache, float *k_scales,
                               float *v_scales, const long *slots, long rows, long Hk, long D, long k_stride,
                               long v_stride, long num_slots, long block_size, int fp8);
int matinee_write_kv_quant_bf16(const void *k, const void *v, uint8_t *k_cache, uint8_t *v_cache, float *k_scales,
                                float *v_scales, const long *slots, long rows, long Hk, long D, long k_stride,
                                long v_stride, long num_slots, long block_size, int fp8);
void matinee_silu_and_mul_f32(const void *x, void *out, long rows, long I, int threads);
void matinee_silu_and_mul_bf16(const void *x, void *out, long rows, long I, int threads);
int matinee_paged_attention(const void *q, const void *k_cache, const void *v_cache, const float *k_scales,
                            const float *v_scales, const int *block_tables, const int *query_start_loc,
                            const int *seq_lens, void *out, long B, long T, long Hq, long Hk, long D, long block_size,
                            long table_width, long num_blocks, float scale, int threads, int act_bf16,
                            int cache_kind, long short_max);

int matinee_lora_add(const void *x, long x_stride, void *out, long out_stride, int act_bf16, const void *a,
                     const void *b, int w_bf16, long K, long R, long N, const long *segments, long n_segments,
                     const long *blocks, long n_blocks, int threads);

enum { GGUF = 0, PACKED = 1, PACKED_DOT = 2, PACKED_HALF = 3 };   /* a projection's kernel: quant_gemm.c (qtype),
                                       packed_gemm.c (PACKED_DOT: its vdpbf16ps path for bf16 rows; PACKED_HALF: a
                                       float16 weight) */

typedef struct {
    const void *w;
    const float *bias;   /* float32 [N], or NULL */
    long N, K;
    int kind, qtype;
    long amx_from;       /* bf16 rows: quant_amx.c from this many rows on (a packed bf16 weight as BF16P); 0 never */
} Part;

#define MAX_PARTS 3
typedef struct {
    Part part[MAX_PARTS];   /* output columns side by side: a K-quant mix stores q and k in Q4_K, v in Q6_K */
    int parts;
} Projection;

typedef struct {
    const void *input_norm, *post_norm, *q_norm, *k_norm;   /* [width] in the activations' dtype; q/k_norm or NULL */
    Projection qkv, o, gate_up, down;
} Layer;

typedef struct {
    void *k, *v;             /* [num_blocks, block_size, Hk, D] */
    float *k_scales, *v_scales;   /* [num_blocks, Hk] for an int8 or fp8 cache, else NULL */
} LayerCache;

typedef struct {
    long hidden, Hq, Hk, D, intermediate, block_size, num_blocks, table_width, cos_sin_rows;
    long short_max;          /* query runs up to this long take the decode attention kernel, longer the prefill one */
    float eps, scale;
    int bf16;                /* activations and norms in bfloat16, else float32 */
    int cache;               /* paged_attention_cpu.c's kind: 0 float32, 1 bfloat16 (the activations'), 2 int8, 3 fp8 e4m3 */
    const float *cos_sin;    /* [cos_sin_rows, D] float32 */
} Shape;

/* A step's LoRA adapters (lora_sgmv.c's arguments), per projection group in the order qkv, o, gate_up, down. */
enum { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3 };
typedef struct {
    const long *segments;    /* [n_segments][4]: start, end, slot, rank; n_segments 0: no row adapts the group */
    long n_segments;
    const long *blocks;      /* [n_blocks][3]: rank_at, out_at, width */
    long n_blocks, R;        /* R: the stacks' rank columns */
} LoRAGroup;
typedef struct {
    LoRAGroup group[4];
    const void *const *stacks;   /* [layers][4][2]: each group's A [slots, K, R] and B [slots, R, N] */
    int w_bf16;
} LoRA;

/* out [T, N] (row stride N) += the rows' adapters' x [T, K] @ A @ B, as model.py's loop adds them after the
 * projection, through the same kernel. */
static int adapt(const LoRA *lora, long layer, int g, const void *x, long K, void *out, long N, int bf16,
                 int threads) {
    if (lora == NULL || lora->group[g].n_segments == 0) return 0;
    const LoRAGroup *gr = lora->group + g;
    const void *const *ab = lora->stacks + 8 * layer + 2 * g;
    return matinee_lora_add(x, K, out, N, bf16, ab[0], ab[1], lora->w_bf16, K, gr->R, N, gr->segments,
                            gr->n_segments, gr->blocks, gr->n_blocks, threads);
}

static int project_part(const Part *p, const void *x, void *y, long M, int bf16, int threads) {
    if (bf16 && p->amx_from && M >= p->amx_from)
        return matinee_quant_amx(x, p->kind == GGUF ? p->qtype : BF16P, p->w, p->bias, y, M, p->N, p->K, threads);
    if (p->kind == GGUF) return matinee_quant_gemm(x, bf16, p->qtype, p->w, p->bias, y, bf16, M, p->N, p->K, threads);
    return matinee_packed_gemm(x, bf16, p->w, p->kind == PACKED_HALF, p->bias, y, bf16, M, p->N, p->K, threads,
                               p->kind == PACKED_DOT && bf16);
}

/* y [M, sum of the parts' N] = x @ the parts' weights, side by side (as quant_linear.stacked concatenates them). */
static int project(const Projection *p, const void *x, void *y, long M, int bf16, int threads) {
    if (p->parts == 1) return project_part(p->part, x, y, M, bf16, threads);
    const long el = bf16 ? 2 : 4;
    long N = 0, widest = 0;
    for (int j = 0; j < p->parts; j++) {
        N += p->part[j].N;
        if (p->part[j].N > widest) widest = p->part[j].N;
    }
    char *out = malloc(el * M * widest + 64);
    if (out == NULL) return -1;
    int status = 0;
    for (long j = 0, at = 0; j < p->parts && status == 0; at += p->part[j].N, j++) {
        status = project_part(p->part + j, x, out, M, bf16, threads);
        for (long m = 0; m < M && status == 0; m++)
            memcpy((char *)y + el * (m * N + at), out + el * m * p->part[j].N, el * p->part[j].N);
    }
    free(out);
    return status;
}

/* embeddings [T, H] -> hidden [T, H], the last layer's output, and residual [T, H], its residual stream,
 * as the layer loop leaves them for the final norm. positions and slots int64 [T]; attention metadata as
 * matinee_paged_attention's. Returns 0; -1 out of memory; -2, -3 the attention kernel's metadata errors;
 * -4 a position outside the rotary table; -5 a slot outside the cache (the kernels' own checks, in
 * the layer loop's order: nothing is written before them); -6 a projection's kernel refused; -7 a head
 * shape the attention kernels do not take (decode_layers.py sends none). `layer_written`, where not NULL,
 * is called with each layer's index once its KV is in the cache (a prompt handed over goes layer by layer).
 * `lora`, where not NULL, adds the rows' adapters to every projection it names (-1 out of memory there). */
int matinee_decode_layers(const Layer *layers, const LayerCache *caches, long L, const Shape *s,
                          const void *embeddings, void *hidden, void *residual, const long *positions, const long *slots, const int *block_tables,
                          const int *query_start_loc, const int *seq_lens, long B, long T, int threads,
                          void (*layer_written)(long), const LoRA *lora) {
    const long H = s->hidden, Hq = s->Hq, Hk = s->Hk, D = s->D, I = s->intermediate;
    const long q_size = Hq * D, kv_size = Hk * D, qkv_width = q_size + 2 * kv_size;
    const long el = s->bf16 ? 2 : 4;
    const int bf16 = s->bf16;
    void (*rms_norm)(const void *, const void *, void *, const void *, void *, long, long, float, int) =
        bf16 ? matinee_rms_norm_bf16 : matinee_rms_norm_f32;
    int (*rope)(const long *, void *, void *, const float *, long, long, long, long, long, long, long, int) =
        bf16 ? matinee_rope_bf16 : matinee_rope_f32;
    long widest = qkv_width > 2 * I ? qkv_width : 2 * I, x_width = H > q_size ? H : q_size;
    char *scratch = malloc(el * T * (H + x_width + widest + 2 * q_size + kv_size + I) + 64);
    if (scratch == NULL) return -1;
    /* x: the attention's projection, or q copied out of the fused output for its norm */
    char *normed = scratch, *x = normed + el * T * H, *qkv = x + el * T * x_width, *q = qkv + el * T * widest;
    char *knormed = q + el * T * q_size, *attn = knormed + el * T * kv_size, *act = attn + el * T * q_size;
    char *gate_up = qkv;   /* the fused qkv output is dead by the time the MLP runs */
    int status = 0;
    for (long l = 0; l < L && status == 0; l++) {
        const Layer *ly = layers + l;
        const LayerCache *c = caches + l;
        if (l == 0) {   /* the first layer's residual is the embeddings themselves */
            memcpy(residual, embeddings, el * T * H);
            rms_norm(embeddings, NULL, NULL, ly->input_norm, normed, T, H, s->eps, threads);
        } else {   /* residual += hidden, in place: each element is read before it is written */
            rms_norm(hidden, residual, residual, ly->input_norm, normed, T, H, s->eps, threads);
        }
        if (project(&ly->qkv, normed, qkv, T, bf16, threads)) { status = -6; break; }
        if (adapt(lora, l, QKV, normed, H, qkv, qkv_width, bf16, threads)) { status = -1; break; }
        /* q and k rotate in place where they lie in the fused output; per-head norms write them out first */
        char *qp = qkv, *kp = qkv + el * q_size, *vp = qkv + el * (q_size + kv_size);
        long q_stride = qkv_width, k_stride = qkv_width;
        if (ly->q_norm != NULL) {
            for (long t = 0; t < T; t++) {   /* the strided view copied out, as .reshape copies it */
                memcpy(x + el * t * q_size, qp + el * t * qkv_width, el * q_size);
                memcpy(attn + el * t * kv_size, kp + el * t * qkv_width, el * kv_size);
            }
            rms_norm(x, NULL, NULL, ly->q_norm, q, T * Hq, D, s->eps, threads);
            rms_norm(attn, NULL, NULL, ly->k_norm, knormed, T * Hk, D, s->eps, threads);
            qp = q, kp = knormed, q_stride = q_size, k_stride = kv_size;
        }
        if (rope(positions, qp, kp, s->cos_sin, T, Hq, Hk, D, q_stride, k_stride, s->cos_sin_rows, threads)) {
            status = -4;
            break;
        }
        long num_slots = s->num_blocks * s->block_size;
        int written = s->cache < 2
            ? (bf16 ? matinee_write_kv_bf16 : matinee_write_kv_f32)(kp, vp, c->k, c->v, slots, T, kv_size, k_stride,
                                                                    qkv_width, num_slots, threads)
            : (bf16 ? matinee_write_kv_quant_bf16 : matinee_write_kv_quant_f32)(
                  kp, vp, c->k, c->v, c->k_scales, c->v_scales, slots, T, Hk, D, k_stride, qkv_width, num_slots,
                  s->block_size, s->cache == 3);
        if (written) { status = -5; break; }
        if (layer_written != NULL) layer_written(l);
        if (qp != q) {   /* the attention kernel reads q contiguous */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T >= 64)
            for (long t = 0; t < T; t++) memcpy(q + el * t * q_size, qp + el * t * q_stride, el * q_size);
        }
        status = matinee_paged_attention(q, c->k, c->v, c->k_scales, c->v_scales, block_tables, query_start_loc,
                                         seq_lens, attn, B, T, Hq, Hk, D, s->block_size, s->table_width,
                                         s->num_blocks, s->scale, threads, bf16, s->cache, s->short_max);
        if (status == -4) status = -7;   /* -4 is the rotary table's here */
        if (status) break;
        if (project(&ly->o, attn, x, T, bf16, threads)) { status = -6; break; }
        if (adapt(lora, l, O, attn, q_size, x, H, bf16, threads)) { status = -1; break; }
        rms_norm(x, residual, residual, ly->post_norm, normed, T, H, s->eps, threads);
        if (project(&ly->gate_up, normed, gate_up, T, bf16, threads)) { status = -6; break; }
        if (adapt(lora, l, GATE_UP, normed, H, gate_up, 2 * I, bf16, threads)) { status = -1; break; }
        (bf16 ? matinee_silu_and_mul_bf16 : matinee_silu_and_mul_f32)(gate_up, act, T, I, threads);
        if (project(&ly->down, act, hidden, T, bf16, threads)) { status = -6; break; }
        if (adapt(lora, l, DOWN, act, I, hidden, H, bf16, threads)) { status = -1; break; }
    }
    free(scratch);
    return status;
}
