/* The GGUF block decoders (one copy, for quant.c's products and decode.c's single-token step) and a row's dot
 * product with an fp32 x. The block layouts and why every decoded value is exact: quant.c's opening comment. */
#ifndef LLMI_QUANT_OPS_H
#define LLMI_QUANT_OPS_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float qv16 __attribute__((vector_size(64), aligned(4)));     /* sixteen floats, unaligned loads */

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13,
       GGML_Q6_K = 14 };

/* An IEEE half (little-endian bytes) as a float: exact, subnormals, infinities and NaNs included. */
static inline float half(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (e == 0) {                                   /* zero or subnormal: m 2^-24, exact in fp32 */
        v.f = (float)m * 0x1p-24f;
        v.u |= sign;
    } else {
        v.u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    }
    return v.f;
#endif
}

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline qv16 q_load16(const float *p) { return *(const qv16 *)p; }

/* The sixteen lanes' sum, pairwise (four dependent adds instead of fifteen at the end of every row). */
static inline float q_hsum(qv16 v) {
    float s[16];
    memcpy(s, &v, sizeof s);
    for (int w = 8; w; w /= 2)
        for (int i = 0; i < w; i++) s[i] += s[i + w];
    return s[0];
}

/* ---- one block's values, in order, as vectors of sixteen (v[i]: elements 16 i .. 16 i + 15) ----
 * Each sixteen bytes are widened to 32-bit lanes first (one vpmovzxbd) and their bits taken apart there: x86 has no
 * shifts of byte lanes (GCC emulates them, a left shift by four as four additions). A value d (q - o) is one FMA,
 * q d - o d: its exact value is representable (the header's 24 bits), so the FMA gives it exactly, as gguf-py's
 * d * (q - o) does; d q + m is one rounding of an exact product either way. */

typedef uint8_t qb16 __attribute__((vector_size(16), aligned(1)));     /* sixteen bytes, unaligned */
typedef uint32_t qu16 __attribute__((vector_size(64)));

/* Sixteen bytes as sixteen 32-bit lanes. GCC 12 lowers __builtin_convertvector of bytes to 32-bit lanes one lane at
 * a time (sixteen loads and inserts), so AVX-512 gets its one instruction by name. */
static inline qu16 widen(const uint8_t *p) {
#if defined(__AVX512F__)
    return (qu16)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return __builtin_convertvector(*(const qb16 *)p, qu16);
#endif
}
static inline qv16 fl(qu16 q) { return __builtin_convertvector((__attribute__((vector_size(64))) int32_t)q, qv16); }

/* low | 16 in lane j where bit j of the sixteen bits `bits` is set: the fifth bits of Q5_0/Q5_1's elements (bits
 * 0-15 of qh for elements 0-15, bits 16-31 for 16-31). AVX-512 takes the bits as a lane mask (one masked or). */
static inline qu16 with_fifth(qu16 low, uint32_t bits) {
#if defined(__AVX512F__)
    return (qu16)_mm512_mask_or_epi32((__m512i)low, (__mmask16)bits, (__m512i)low, _mm512_set1_epi32(16));
#else
    static const qu16 LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return low | (((qu16){0} + bits) >> LANE & 1) << 4;
#endif
}

static inline void deq_q8_0(const uint8_t *b, qv16 *v) {
    /* int8 q = u - 128 for the byte u = q ^ 0x80 (the zero-extending widen is one instruction; GCC 12 widens
     * signed byte vectors lane by lane) */
    const float d = half(b);
    v[0] = fl(widen(b + 2) ^ 0x80) * d - 128.0f * d;
    v[1] = fl(widen(b + 18) ^ 0x80) * d - 128.0f * d;
}

static inline void deq_q4_0(const uint8_t *b, qv16 *v) {
    const float d = half(b);
    const qu16 qs = widen(b + 2);
    v[0] = fl(qs & 15) * d - 8.0f * d;
    v[1] = fl(qs >> 4) * d - 8.0f * d;
}

static inline void deq_q4_1(const uint8_t *b, qv16 *v) {
    const float d = half(b), m = half(b + 2);
    const qu16 qs = widen(b + 4);
    v[0] = fl(qs & 15) * d + m;
    v[1] = fl(qs >> 4) * d + m;
}

static inline void deq_q5_0(const uint8_t *b, qv16 *v) {
    const float d = half(b);
    const uint32_t qh = le32(b + 2);
    const qu16 qs = widen(b + 6);
    v[0] = fl(with_fifth(qs & 15, qh & 0xffff)) * d - 16.0f * d;
    v[1] = fl(with_fifth(qs >> 4, qh >> 16)) * d - 16.0f * d;
}

static inline void deq_q5_1(const uint8_t *b, qv16 *v) {
    const float d = half(b), m = half(b + 2);
    const uint32_t qh = le32(b + 4);
    const qu16 qs = widen(b + 8);
    v[0] = fl(with_fifth(qs & 15, qh & 0xffff)) * d + m;
    v[1] = fl(with_fifth(qs >> 4, qh >> 16)) * d + m;
}

/* Sub-block j's 6-bit scale and min from the 12 packed bytes (llama.cpp's get_scale_min_k4): j < 4 in the low six
 * bits of bytes j and j + 4; j >= 4 in the nibbles of byte j + 4 with the top two bits of bytes j - 4 and j. */
static inline void scale_min(int j, const uint8_t *q, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *mn = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K and Q5_K: sub-block s is 32 values (v[2s], v[2s + 1]): the low nibbles (s even) or high ones (s odd) of the
 * 32 bytes at qs + 32 (s / 2); for Q5_K each value's fifth bit is bit s of byte l of the 32 bytes at qh. */
static inline void deq_k(const uint8_t *b, const uint8_t *qs, const uint8_t *qh, qv16 *v) {
    const float d = half(b), dmin = half(b + 2);
    qu16 high[2] = {{0}, {0}};
    if (qh) { high[0] = widen(qh); high[1] = widen(qh + 16); }
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        float sc, mn;
        scale_min(s, b + 4, &sc, &mn);
        const float ds = d * sc, dm = dmin * mn;
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const qu16 q = widen(qs + 32 * (s / 2) + 16 * h);
            const qu16 low = s & 1 ? q >> 4 : q & 15;
            const qu16 fifth = s <= 4 ? high[h] << (4 - s) & 16 : high[h] >> (s - 4) & 16;       /* bit s */
            v[2 * s + h] = fl(qh ? low | fifth : low) * ds - dm;
        }
    }
}

static inline void deq_q4_k(const uint8_t *b, qv16 *v) { deq_k(b, b + 16, 0, v); }
static inline void deq_q5_k(const uint8_t *b, qv16 *v) { deq_k(b, b + 48, b + 16, v); }

/* Q6_K: in each half of 128 values, element 32 s + l takes its low four bits from byte 32 (s & 1) + l of the half's
 * 64 bytes of ql (the high nibble for s >= 2) and its top two from bits 2s of byte l of the half's 32 bytes of qh;
 * each 16 values have their own int8 scale. */
static inline void deq_q6_k(const uint8_t *b, qv16 *v) {
    const float d = half(b + 208);
    /* the sixteen scales d sc (exact: an int8 times an fp16) and -32 d sc, at once; each is then one broadcast */
    const qv16 scale = (fl(widen(b + 192) ^ 0x80) - 128.0f) * d, offset = -32.0f * scale;
    float ds[16], dz[16];
    memcpy(ds, &scale, sizeof ds);
    memcpy(dz, &offset, sizeof dz);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++) {                       /* elements 32 s + 16 p .. + 15 of the half */
            const qu16 hi = widen(qh + 16 * p), lo0 = widen(ql + 16 * p), lo1 = widen(ql + 32 + 16 * p);
#pragma GCC unroll 4
            for (int s = 0; s < 4; s++) {
                const qu16 lo = s & 1 ? lo1 : lo0;
                const qu16 top = s < 2 ? hi << (4 - 2 * s) & 48 : hi >> (2 * s - 4) & 48;   /* bits 2s, 2s+1 */
                const qu16 q = (s >= 2 ? lo >> 4 : lo & 15) | top;
                const int i = 8 * h + 2 * s + p;
                v[i] = fl(q) * ds[i] + dz[i];
            }
        }
    }
}


/* Values the one-row loop decodes a step: two 32-value blocks or one K-quant super-block, sixteen vectors or four */
#define Q_STEP(QK) ((QK) >= 64 ? (QK) : 64)

/* One row of W (nb blocks at `row`) dot x (K = nb QK values): four sums, so that four multiply-adds are in flight.
 * quant.c's product at one row of x and decode.c's single-token step both call it, so the two sum alike. */
#define QUANT_DOT(NAME, QK, BYTES, DEQ)                                                                        \
static inline float NAME(const uint8_t *row, long nb, const float *xr) {                                       \
    qv16 a[4] = {{0}};                                                                                         \
    long j = 0;                                                                                                \
    for (; j + Q_STEP(QK) / (QK) <= nb; j += Q_STEP(QK) / (QK)) {                                              \
        qv16 v[Q_STEP(QK) / 16];                                                                               \
        for (int u = 0; u < Q_STEP(QK) / (QK); u++) DEQ(row + (size_t)(j + u) * (BYTES), v + u * (QK) / 16);  \
        _Pragma("GCC unroll 16")                                                                               \
        for (int i = 0; i < Q_STEP(QK) / 16; i++) a[i & 3] += v[i] * q_load16(xr + (size_t)j * (QK) + 16 * i); \
    }                                                                                                          \
    for (; j < nb; j++) {                                                                                      \
        qv16 v[(QK) / 16];                                                                                     \
        DEQ(row + (size_t)j * (BYTES), v);                                                                     \
        for (int i = 0; i < (QK) / 16; i++) a[i & 3] += v[i] * q_load16(xr + (size_t)j * (QK) + 16 * i);     \
    }                                                                                                          \
    return q_hsum((a[0] + a[1]) + (a[2] + a[3]));                                                              \
}

QUANT_DOT(dot_q8_0, 32, 34, deq_q8_0)
QUANT_DOT(dot_q4_0, 32, 18, deq_q4_0)
QUANT_DOT(dot_q4_1, 32, 20, deq_q4_1)
QUANT_DOT(dot_q5_0, 32, 22, deq_q5_0)
QUANT_DOT(dot_q5_1, 32, 24, deq_q5_1)
QUANT_DOT(dot_q4_k, 256, 144, deq_q4_k)
QUANT_DOT(dot_q5_k, 256, 176, deq_q5_k)
QUANT_DOT(dot_q6_k, 256, 210, deq_q6_k)

/* W's row n (nb blocks) dot x for the GGML type `type`; the caller has checked the type (q_block_bytes > 0). */
static inline float q_dot(int type, const uint8_t *w, long n, long nb, const float *x) {
    switch (type) {
    case GGML_Q8_0: return dot_q8_0(w + (size_t)n * nb * 34, nb, x);
    case GGML_Q4_0: return dot_q4_0(w + (size_t)n * nb * 18, nb, x);
    case GGML_Q4_1: return dot_q4_1(w + (size_t)n * nb * 20, nb, x);
    case GGML_Q5_0: return dot_q5_0(w + (size_t)n * nb * 22, nb, x);
    case GGML_Q5_1: return dot_q5_1(w + (size_t)n * nb * 24, nb, x);
    case GGML_Q4_K: return dot_q4_k(w + (size_t)n * nb * 144, nb, x);
    case GGML_Q5_K: return dot_q5_k(w + (size_t)n * nb * 176, nb, x);
    default:        return dot_q6_k(w + (size_t)n * nb * 210, nb, x);
    }
}

/* Values a block of the GGML type holds (32 or 256), 0 for a type these decoders do not implement. */
static inline long q_block_values(int type) {
    switch (type) {
    case GGML_Q8_0: case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: return 32;
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return 256;
    default: return 0;
    }
}

#endif
