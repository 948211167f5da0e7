/* A layer's small ops on the CPU in one call each: RMSNorm (with the residual add), rotary
 * embedding, the KV cache write (also into an int8 or fp8 cache, by kv_quant.py's rule) and
 * SiLU-and-multiply, in float32 or bfloat16.
 *
 * In torch each of these is 8-20 small ops (a cast, a power, a mean, a slice, a cat...), every one
 * a dispatch of a few microseconds: at one decode token, 30 layers' worth took about a third of
 * SmolLM2's step, more than its attention. Here each is one loop over the rows, in the same order
 * of roundings as the references (rms_norm.py, rope.py, kv_write.py): products and sums in float32,
 * rounded to the tensor's dtype where the reference casts. A row's sum of squares runs in vector lanes
 * (`omp simd`), in an order fixed by the build, never by the batch. Built by cpu_native.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "e4m3.h"

static inline float bf16_load(const uint16_t *p) { return bf16_to_f32(*p); }
static inline uint16_t bf16_round(float f) { return f32_to_bf16(f); }
static inline float f32_load(const float *p) { return *p; }
static inline float f32_round(float f) { return f; }

/* rows >= 64 (a prefill chunk) share the rows between threads; a decode step's few rows cost less
 * than waking a second thread. */
#define PARALLEL_ROWS(threads, rows) _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 64)")
/* SiLU-and-multiply takes 2I exponentials a row: worth a second thread from 8 rows. */
#define PARALLEL_SILU_ROWS(threads, rows) _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 8)")

/* out[t] = rms_norm(r[t]) * weight, where r = x + residual when residual is given (then written to
 * residual_out), else r = x. Rows have stride H. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, ROUND)                                                              \
    void NAME(const T *x, const T *residual, T *residual_out, const T *weight, T *out, long rows, long H,   \
              float eps, int threads) {                                                                    \
        PARALLEL_ROWS(threads, rows)                                                                       \
        for (long t = 0; t < rows; t++) {                                                                  \
            const T *xr = x + t * H;                                                                       \
            T *o = out + t * H;                                                                            \
            float sum = 0.f;                                                                               \
            if (residual != 0) {                                                                           \
                const T *rr = residual + t * H;                                                            \
                T *ro = residual_out + t * H;                                                              \
                _Pragma("omp simd reduction(+:sum)")                                                       \
                for (long i = 0; i < H; i++) {                                                             \
                    T r = ROUND(LOAD(xr + i) + LOAD(rr + i));                                              \
                    float rf = LOAD(&r);                                                                   \
                    ro[i] = r;                                                                             \
                    sum += rf * rf;                                                                        \
                }                                                                                          \
                xr = ro;                                                                                   \
            } else {                                                                                       \
                _Pragma("omp simd reduction(+:sum)")                                                       \
                for (long i = 0; i < H; i++) sum += LOAD(xr + i) * LOAD(xr + i);                           \
            }                                                                                              \
            float inv = 1.f / sqrtf(sum / (float)H + eps);                                                 \
            for (long i = 0; i < H; i++) {                                                                 \
                T normed = ROUND(LOAD(xr + i) * inv);                                                      \
                o[i] = ROUND(LOAD(weight + i) * LOAD(&normed));                                            \
            }                                                                                              \
        }                                                                                                  \
    }

/* Neox-style rotation in place: for each token, the first and second halves of every head of q and
 * k (token strides q_stride, k_stride; heads contiguous, D apart) rotate by the angles of its
 * position, cos_sin[pos] = cat(cos, sin). Returns -2 for a position outside the table. */
#define DEFINE_ROPE(NAME, T, LOAD, ROUND)                                                                  \
    int NAME(const long *positions, T *q, T *k, const float *cos_sin, long rows, long Hq, long Hk, long D,  \
             long q_stride, long k_stride, long max_pos, int threads) {                                     \
        for (long t = 0; t < rows; t++)                                                                    \
            if (positions[t] < 0 || positions[t] >= max_pos) return -2;                                    \
        long half = D / 2;                                                                                 \
        PARALLEL_ROWS(threads, rows)                                                                       \
        for (long t = 0; t < rows; t++) {                                                                  \
            const float *c = cos_sin + positions[t] * D, *s = c + half;                                    \
            for (long h = 0; h < Hq + Hk; h++) {                                                           \
                T *x = h < Hq ? q + t * q_stride + h * D : k + t * k_stride + (h - Hq) * D;                \
                for (long i = 0; i < half; i++) {                                                          \
                    float x1 = LOAD(x + i), x2 = LOAD(x + half + i);                                       \
                    x[i] = ROUND(x1 * c[i] - x2 * s[i]);                                                   \
                    x[half + i] = ROUND(x2 * c[i] + x1 * s[i]);                                            \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        return 0;                                                                                          \
    }

/* Row t of k and v (width W = Hk * D, token strides k_stride, v_stride) goes to cache slot
 * slots[t]; a negative slot (padding) writes nothing. Returns -3 for a slot outside the cache, before
 * anything is written. A prefill chunk's rows are shared between the threads (with the C layer loop's copy
 * of q, 2.5% of a 512-token prefill step when one thread copied them while the other waited). */
#define DEFINE_WRITE_KV(NAME, T)                                                                           \
    int NAME(const T *k, const T *v, T *k_cache, T *v_cache, const long *slots, long rows, long W,          \
             long k_stride, long v_stride, long num_slots, int threads) {                                   \
        for (long t = 0; t < rows; t++)                                                                    \
            if (slots[t] >= num_slots) return -3;                                                          \
        PARALLEL_ROWS(threads, rows)                                                                       \
        for (long t = 0; t < rows; t++) {                                                                  \
            if (slots[t] < 0) continue;                                                                    \
            memcpy(k_cache + slots[t] * W, k + t * k_stride, W * sizeof(T));                               \
            memcpy(v_cache + slots[t] * W, v + t * v_stride, W * sizeof(T));                               \
        }                                                                                                  \
        return 0;                                                                                          \
    }

static inline float clampf(float x, float bound) { return x < -bound ? -bound : x > bound ? bound : x; }

/* One quantized value: int8 (clamped to +-127) or fp8 e4m3 (clamped to +-448), from x already divided
 * by its scale, to nearest even. */
static inline uint8_t quantize1(float x, int fp8) {
    if (fp8) return f32_to_e4m3(clampf(x, 448.f));
    return (uint8_t)(int8_t)rintf(clampf(x, 127.f));
}

static inline float code_value(uint8_t c, int fp8) { return fp8 ? e4m3_to_f32(c) : (float)(int8_t)c; }

/* kv_quant.py's rule for one head's D values x written at offset `off` of a block: head[j * stride + i]
 * is value i of the block's slot j for this head; *scale is the (block, head) scale. The loops are
 * plain so that they vectorise: requantizing a block's earlier tokens is most of a prefill's write. */
static void write_quantized_head(const float *x, uint8_t *head, float *scale, long off, long stride, long D,
                                 int fp8) {
    float qmax = fp8 ? 448.f : 127.f, amax = 0.f;
    for (long i = 0; i < D; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float old = off == 0 ? 0.f : *scale, s = old;
    if (amax > old * qmax) {
        s = amax / qmax;
        if (old > 0.f) {   /* the scale grows: the tokens already written for this head move to it */
            float factor = old / s;
            for (long j = 0; j < off; j++) {
                uint8_t *row = head + j * stride;
                for (long i = 0; i < D; i++) row[i] = quantize1(code_value(row[i], fp8) * factor, fp8);
            }
        }
    }
    *scale = s;
    float divisor = s > 0.f ? s : 1.f;   /* 0: nothing but zeros so far */
    uint8_t *row = head + off * stride;
    for (long i = 0; i < D; i++) row[i] = quantize1(x[i] / divisor, fp8);
}

/* Row t of k and v ([Hk, D] each, token strides k_stride, v_stride) into an int8 (fp8 = 0) or fp8 e4m3
 * cache [num_slots / block_size, block_size, Hk, D] at slot slots[t], in order (the rule depends on
 * it), with its scales [num_blocks, Hk]; a negative slot writes nothing. Returns -3 for a slot outside
 * the cache, before anything is written. */
#define DEFINE_WRITE_KV_QUANT(NAME, T, LOAD)                                                               \
    int NAME(const T *k, const T *v, uint8_t *k_cache, uint8_t *v_cache, float *k_scales, float *v_scales,  \
             const long *slots, long rows, long Hk, long D, long k_stride, long v_stride, long num_slots,   \
             long block_size, int fp8) {                                                                   \
        for (long t = 0; t < rows; t++)                                                                    \
            if (slots[t] >= num_slots) return -3;                                                          \
        float x[D];                                                                                        \
        for (long t = 0; t < rows; t++) {                                                                  \
            if (slots[t] < 0) continue;                                                                    \
            long block = slots[t] / block_size, off = slots[t] % block_size;                               \
            for (long h = 0; h < Hk; h++) {                                                                \
                long head = block * block_size * Hk * D + h * D;   /* slot 0 of the block, this head */    \
                for (long i = 0; i < D; i++) x[i] = LOAD(k + t * k_stride + h * D + i);                    \
                write_quantized_head(x, k_cache + head, k_scales + block * Hk + h, off, Hk * D, D, fp8);   \
                for (long i = 0; i < D; i++) x[i] = LOAD(v + t * v_stride + h * D + i);                    \
                write_quantized_head(x, v_cache + head, v_scales + block * Hk + h, off, Hk * D, D, fp8);   \
            }                                                                                              \
        }                                                                                                  \
        return 0;                                                                                          \
    }

/* e^x, Cephes' expf polynomial (within 2 ulp of expf) in plain branch-free C, so that gcc vectorises
 * the loops that call it: glibc's expf is a call per element. x is clamped to where e^x is a finite
 * nonzero float; a NaN comes out as NaN through the caller's arithmetic. */
static inline float fast_exp(float x) {
    x = x < -87.3f ? -87.3f : x > 88.3f ? 88.3f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f - n * -2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* out[t] = silu(x[t, :I]) * x[t, I:], rows of x 2I wide: silu rounded to the dtype before the product,
 * as F.silu(a) * b computes it. gcc vectorises it 8 lanes wide unless asked for 16 where the CPU has them:
 * 0.73 -> 0.53 ms for 1024 x 1536 bf16 outputs on 2 Xeon cores; no sum, so the bits do not change. */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, ROUND)                                                          \
    __attribute__((target("prefer-vector-width=512")))                                                     \
    void NAME(const T *x, T *out, long rows, long I, int threads) {                                        \
        PARALLEL_SILU_ROWS(threads, rows)                                                                  \
        for (long t = 0; t < rows; t++) {                                                                  \
            const T *a = x + t * 2 * I, *b = a + I;                                                        \
            T *o = out + t * I;                                                                            \
            _Pragma("omp simd")                                                                            \
            for (long i = 0; i < I; i++) {                                                                 \
                float v = LOAD(a + i);                                                                     \
                T s = ROUND(v / (1.f + fast_exp(-v)));                                                     \
                o[i] = ROUND(LOAD(&s) * LOAD(b + i));                                                      \
            }                                                                                              \
        }                                                                                                  \
    }

DEFINE_RMS_NORM(matinee_rms_norm_f32, float, f32_load, f32_round)
DEFINE_ROPE(matinee_rope_f32, float, f32_load, f32_round)
DEFINE_ROPE(matinee_rope_bf16, uint16_t, bf16_load, bf16_round)
DEFINE_WRITE_KV(matinee_write_kv_f32, float)
DEFINE_WRITE_KV(matinee_write_kv_bf16, uint16_t)
DEFINE_WRITE_KV_QUANT(matinee_write_kv_quant_f32, float, f32_load)
DEFINE_WRITE_KV_QUANT(matinee_write_kv_quant_bf16, uint16_t, bf16_load)
#if defined(__AVX2__) && !defined(__AVX512F__)
/* Without AVX-512's masks gcc does not if-convert fast_exp's clamps, and the loop above ran one float at a time:
 * 4% of a 1B model's prefill on a Zen 3. Here 8 at a time through exp8 (the same polynomial, clamped alike; a NaN
 * stays NaN through the division). */
#include "vexp.h"

void matinee_silu_and_mul_f32(const float *x, float *out, long rows, long I, int threads) {
    PARALLEL_SILU_ROWS(threads, rows)
    for (long t = 0; t < rows; t++) {
        const float *a = x + t * 2 * I, *b = a + I;
        float *o = out + t * I;
        long i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 v = _mm256_loadu_ps(a + i);
            const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), v), _mm256_set1_ps(88.3f)));
            const __m256 s = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(b + i)));
        }
        for (; i < I; i++) o[i] = a[i] / (1.f + fast_exp(-a[i])) * b[i];
    }
}
#else
DEFINE_SILU_AND_MUL(matinee_silu_and_mul_f32, float, f32_load, f32_round)
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* The bf16 RMSNorm 16 lanes at a time, rounding by the hardware (vcvtneps2bf16) where every lane is a
 * normal number, a zero or an infinity; a vector with a NaN or a denormal lane (which the instruction would
 * flush, or give its sign) rounds through f32_to_bf16, so the values are the scalar loop's. Rounding by
 * integer ops was most of that loop's work: 512 rows x 576 took 76 -> 52 us on 2 Xeon cores. SiLU-and-multiply
 * below rounds the same way. */
#include <immintrin.h>

#include "vexp.h"

static inline __mmask16 lanes(long i, long n) { return n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1); }

static inline __m512 load16(const uint16_t *p, __mmask16 k) { return bf16x16_to_f32(_mm256_maskz_loadu_epi16(k, p)); }

static inline __m256i round16(__m512 f) {
    if (_mm512_fpclass_ps_mask(f, 0x01 | 0x20 | 0x80)) {   /* a quiet NaN, a denormal, a signalling NaN */
        float v[16];
        uint16_t h[16];
        _mm512_storeu_ps(v, f);
        for (int i = 0; i < 16; i++) h[i] = f32_to_bf16(v[i]);
        return _mm256_loadu_si256((const __m256i *)h);
    }
    return (__m256i)_mm512_cvtneps_pbh(f);
}

void matinee_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *residual_out, const uint16_t *weight,
                           uint16_t *out, long rows, long H, float eps, int threads) {
    PARALLEL_ROWS(threads, rows)
    for (long t = 0; t < rows; t++) {
        const uint16_t *xr = x + t * H;
        __m512 acc = _mm512_setzero_ps();
        if (residual != 0) {
            const uint16_t *rr = residual + t * H;
            uint16_t *ro = residual_out + t * H;
            for (long i = 0; i < H; i += 16) {
                __mmask16 k = lanes(i, H);
                __m256i r = round16(_mm512_add_ps(load16(xr + i, k), load16(rr + i, k)));
                _mm256_mask_storeu_epi16(ro + i, k, r);
                acc = _mm512_fmadd_ps(bf16x16_to_f32(r), bf16x16_to_f32(r), acc);
            }
            xr = ro;
        } else {
            for (long i = 0; i < H; i += 16) {
                __m512 v = load16(xr + i, lanes(i, H));
                acc = _mm512_fmadd_ps(v, v, acc);
            }
        }
        __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)H + eps));
        for (long i = 0; i < H; i += 16) {
            __mmask16 k = lanes(i, H);
            __m512 normed = bf16x16_to_f32(round16(_mm512_mul_ps(load16(xr + i, k), inv)));
            _mm256_mask_storeu_epi16(out + t * H + i, k, round16(_mm512_mul_ps(load16(weight + i, k), normed)));
        }
    }
}

/* SiLU-and-multiply 16 lanes at a time: 1 / (1 + e^-v) as a reciprocal estimate refined by one Newton step
 * (relative error ~2^-23, where the scalar loop's division is exact: the bf16 silu rounds the same almost
 * always, and one rounding step apart at most). The division was 7% of a 2 x 256 prefill step on 2 Xeon cores;
 * without it the step measured ~4% faster (alone in a loop, the two versions timed alike). */
void matinee_silu_and_mul_bf16(const uint16_t *x, uint16_t *out, long rows, long I, int threads) {
    PARALLEL_SILU_ROWS(threads, rows)
    for (long t = 0; t < rows; t++) {
        const uint16_t *a = x + t * 2 * I, *b = a + I;
        uint16_t *o = out + t * I;
        for (long i = 0; i < I; i += 16) {
            __mmask16 k = lanes(i, I);
            __m512 v = load16(a + i, k);
            /* e^-v clamped where it would overflow: the sigmoid is then 0 to a float's precision */
            __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_min_ps(_mm512_set1_ps(88.3f), _mm512_sub_ps(_mm512_setzero_ps(), v))));
            __m512 r = _mm512_rcp14_ps(d);
            r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
            __m512 silu = bf16x16_to_f32(round16(_mm512_mul_ps(v, r)));
            _mm256_mask_storeu_epi16(o + i, k, round16(_mm512_mul_ps(silu, load16(b + i, k))));
        }
    }
}

#else
DEFINE_RMS_NORM(matinee_rms_norm_bf16, uint16_t, bf16_load, bf16_round)
DEFINE_SILU_AND_MUL(matinee_silu_and_mul_bf16, uint16_t, bf16_load, bf16_round)
#endif
