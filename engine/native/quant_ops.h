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

#if defined(__AVX512F__)
/* ---- AVX-512: the row dot products written out (the portable ones below, #else, are the block decoders above and
 * QUANT_DOT) ----
 * The same exact weights (each one FMA of its exact value, rounded once, as above) with fewer operations a value,
 * because decoding, not memory, bounds these products: sixteen bytes are widened once (vpmovzxbd, the one shuffle a
 * sixteen values) and give both nibbles; a 4-bit sub-block's or block's sixteen possible weights are a table its codes
 * look up (vpermps: one operation where converting and scaling took two); the fp16 scales of sixteen 32-value blocks,
 * and the packed 6-bit scales of sixteen K-quant super-blocks, are gathered and converted at once and each then read
 * as a memory broadcast (a load, no shuffle); and eight sums are kept (two FMAs a cycle of latency four). Q8_0's scale
 * multiplies each block's q . x (d (q . x): one FMA a block less; the identity still gives d q exactly).
 * The error of a row's sum is the fp32 dot product's whatever the order (gamma_K sum |x_k w_k|:
 * tests/unit/test_quant_matrix.py, test_quant_row_dot.py), and quant.c's one-row product and decode.c's step call
 * these same functions, so the two agree bit for bit. */

typedef __m512 qf;
#define QX(p) _mm512_loadu_ps(p)
#define QF(i) _mm512_cvtepi32_ps(i)
/* *p in all sixteen lanes, read from memory (vbroadcastss m32: a load, no shuffle). Written out because GCC keeps a
 * vector of scales just stored in a register and takes each lane with a shuffle (vpermd), the very port the widening
 * needs. */
static inline __m512 QB(const float *p) {
    __m512 v;
    __asm__("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
    return v;
}
#define QFMA(a, b, c) _mm512_fmadd_ps(a, b, c)

static inline __m512i q_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline __m512i q_s8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline __m512i q_and(__m512i v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
static inline __m512i q_shr(__m512i v, int s) { return _mm512_srli_epi32(v, s); }

/* Read ahead: the lines `bytes` bytes from b, further on in W (the rest of this row, then the next rows, which the
 * same thread takes next: row_product.h's split hands each thread a contiguous range), into L2 from Q_AHEAD_L2 bytes
 * on and into L1 from Q_AHEAD_L1. The hardware prefetcher alone left a row dot waiting on memory: one core streamed a
 * 600 MB Q4_K matrix at ~10 billion values a second against ~21 with the matrix in L2, so the decode step's products
 * ran at half the machine's read speed. Measured here (2026-12-07, two threads, 48 matrices of 4,096 x 4,096 in turn,
 * bits compared): 2,048 bytes ahead into L1 alone (~14 Q4_K super-blocks, several hundred ns of decoding: the time a
 * line takes to come from memory) gave Q4_K, Q4_1, Q5_K and Q6_K 1.3-1.5 times, Q8_0 1.1-1.3 (1,024, 4,096 or 8,192
 * did less; an L2 or non-temporal hint alone no better); the two distances another 1.06 (Q4_K) and 1.2 (Q8_0: 22 GB/s
 * of Q8_0 rows on two threads). A prefetch never faults: reading ahead past the end of W is harmless. Only the
 * loads' timing changes, never a value or the order of the sums. */
enum { Q_AHEAD_L1 = 1024, Q_AHEAD_L2 = 4096 };
static inline void q_prefetch(const uint8_t *b, int bytes) {
    for (int o = 0; o < bytes; o += 64) {
        _mm_prefetch((const char *)b + Q_AHEAD_L1 + o, _MM_HINT_T0);
        _mm_prefetch((const char *)b + Q_AHEAD_L2 + o, _MM_HINT_T1);
    }
}

static inline float q_sum8(qf *a) {
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])),
                                              _mm512_add_ps(_mm512_add_ps(a[4], a[5]), _mm512_add_ps(a[6], a[7]))));
}

/* The fp16 words at byte 0 (lo) and byte 2 (hi, if asked) of n <= 16 consecutive blocks of BYTES bytes, as floats;
 * the n blocks' 32-bit words are gathered (lanes past n are not read). Fewer than eight blocks (a row's tail) are
 * converted one by one instead (the same exact values): a gather costs about as much for two lanes as for sixteen,
 * and a row of 576 values (the bundled model's: 16 blocks and a tail of 2) spent a sixth of its time on it; one
 * core's product of 1,536 x 576 rows in L2 ran 1.05-1.15 times faster in Q4_1, 1.2-1.35 in Q8_0, 1.0 in Q4_0/Q5_0. */
static inline void q_scales16(const uint8_t *b, const int bytes, long n, float *lo, float *hi) {
    if (n < 8) {        /* lanes past n are not read (Q_DC's offsets are then made one by one too: a vector load
                         * of scalar stores waits for them to retire) */
        for (long u = 0; u < n; u++) {
            lo[u] = half(b + u * bytes);
            if (hi) hi[u] = half(b + u * bytes + 2);
        }
        return;
    }
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(bytes));
    const __mmask16 k = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, at, b, 1);
    _mm512_storeu_ps(lo, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w)));
    if (hi) _mm512_storeu_ps(hi, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16))));
}

/* A 32-value block format's row: blocks in chunks of sixteen (their scales at once), BODY(b, xb, u) for block u of
 * the chunk at b with its 32 x values at xb, adding into a[]. SETUP(b, n) makes the chunk's scale arrays. */
#define QDOT32(NAME, BYTES, SETUP, BODY)                                                                        \
static inline float NAME(const uint8_t *row, long nb, const float *xr) {                                       \
    qf a[8];                                                                                                   \
    for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();                                                    \
    const qf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);                        \
    (void)iota;                                                                                                \
    for (long j = 0; j < nb; j += 16) {                                                                        \
        const uint8_t *b0 = row + (size_t)j * (BYTES);                                                         \
        const float *x0 = xr + (size_t)j * 32;                                                                 \
        const long n = nb - j < 16 ? nb - j : 16;                                                              \
        q_prefetch(b0, 16 * (BYTES));                                                                          \
        SETUP(b0, n)                                                                                           \
        /* unrolled whole, the tail too (u < n): a[u & 7] must name a register, not an array in memory */     \
        _Pragma("GCC unroll 16")                                                                               \
        for (int u = 0; u < 16; u++)                                                                           \
            if (u < n) { BODY(b0 + u * (BYTES), x0 + 32 * u, u) }                                              \
    }                                                                                                          \
    return q_sum8(a);                                                                                          \
}

/* d[u] and, for the offset formats, o[u] = -c d[u] (Q4_0, Q5_0) or m[u] (Q4_1, Q5_1) */
#define Q_D(b, n)  float d[16]; q_scales16(b, BYTES_, n, d, 0);
#define Q_DC(b, n) float d[16], o[16]; q_scales16(b, BYTES_, n, d, 0);                                        \
                   if (n < 8) for (long u_ = 0; u_ < n; u_++) o[u_] = d[u_] * -OFF_;                          \
                   else _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(d), _mm512_set1_ps(-OFF_)));
#define Q_DM(b, n) float d[16], o[16]; q_scales16(b, BYTES_, n, d, o);

/* Q8_0: d (q . x) */
#define B_Q8_0(b, xb, u) {                                                                                      \
    const qf t = QFMA(QF(q_s8(b + 18)), QX(xb + 16), _mm512_mul_ps(QF(q_s8(b + 2)), QX(xb)));                  \
    a[u & 7] = QFMA(t, QB(d + u), a[u & 7]); }
/* Q4_0, Q4_1: the low nibbles are elements 0-15, the high ones 16-31; the block's sixteen possible weights d q + o
 * (one FMA each, exact) are a table each code looks its weight up in (vpermps reads an index's low four bits) */
#define B_Q4(at, b, xb, u) {                                                                                    \
    const __m512i q = q_u8(b + at);                                                                            \
    const qf t = QFMA(iota, QB(d + u), QB(o + u));                                                             \
    a[(2 * u) & 7] = QFMA(_mm512_permutexvar_ps(q, t), QX(xb), a[(2 * u) & 7]);                                \
    a[(2 * u + 1) & 7] = QFMA(_mm512_permutexvar_ps(q_shr(q, 4), t), QX(xb + 16), a[(2 * u + 1) & 7]); }
/* Q5_0, Q5_1: the fifth bits (qh's bit i for element i) or-ed in under a lane mask */
#define B_Q5(at, b, xb, u) {                                                                                    \
    const uint32_t qh = le32(b + at - 4);                                                                      \
    const __m512i q = q_u8(b + at), s = _mm512_set1_epi32(16);                                                 \
    const __m512i lo = _mm512_mask_or_epi32(q_and(q, 15), (__mmask16)qh, q_and(q, 15), s);                     \
    const __m512i hi = _mm512_mask_or_epi32(q_shr(q, 4), (__mmask16)(qh >> 16), q_shr(q, 4), s);               \
    a[(2 * u) & 7] = QFMA(QFMA(QF(lo), QB(d + u), QB(o + u)), QX(xb), a[(2 * u) & 7]);                         \
    a[(2 * u + 1) & 7] = QFMA(QFMA(QF(hi), QB(d + u), QB(o + u)), QX(xb + 16), a[(2 * u + 1) & 7]); }

#define B_Q4_0(b, xb, u) B_Q4(2, b, xb, u)
#define B_Q4_1(b, xb, u) B_Q4(4, b, xb, u)
#define B_Q5_0(b, xb, u) B_Q5(6, b, xb, u)
#define B_Q5_1(b, xb, u) B_Q5(8, b, xb, u)

#define BYTES_ 34
QDOT32(dot_q8_0, 34, Q_D, B_Q8_0)
#undef BYTES_
#define BYTES_ 18
#define OFF_ 8.0f
QDOT32(dot_q4_0, 18, Q_DC, B_Q4_0)
#undef BYTES_
#undef OFF_
#define BYTES_ 20
QDOT32(dot_q4_1, 20, Q_DM, B_Q4_1)
#undef BYTES_
#define BYTES_ 22
#define OFF_ 16.0f
QDOT32(dot_q5_0, 22, Q_DC, B_Q5_0)
#undef BYTES_
#undef OFF_
#define BYTES_ 24
QDOT32(dot_q5_1, 24, Q_DM, B_Q5_1)
#undef BYTES_

/* The sub-block scales of n <= 16 K-quant super-blocks (BYTES apart from b), at once: sc[s][t] = d_t sc_s and
 * sc[8 + s][t] = -dmin_t m_s for sub-block s < 8 of super-block t. The twelve packed bytes are unpacked as llama.cpp
 * does, four super-blocks' bytes to a vector of sixteen 32-bit words gathered (scale_min above, byte by byte: s < 4
 * in the low six bits of bytes s and s + 4; s >= 4 in the nibbles of byte s + 4 with the top two bits of bytes s - 4
 * and s). Done for one super-block at a time this was a third of Q4_K's product. */
static inline void q_k_scales16(const uint8_t *b, const int bytes, long n, float sc[16][16]) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(bytes));
    const __mmask16 k = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    const __m512i z = _mm512_setzero_si512(), w = _mm512_mask_i32gather_epi32(z, k, at, b, 1);
    const __m512i a0 = _mm512_mask_i32gather_epi32(z, k, at, b + 4, 1);
    const __m512i a1 = _mm512_mask_i32gather_epi32(z, k, at, b + 8, 1);
    const __m512i a2 = _mm512_mask_i32gather_epi32(z, k, at, b + 12, 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
    const __m512 dmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(q_shr(w, 16))));
    const __m512i top0 = _mm512_slli_epi32(q_and(q_shr(a0, 6), 0x03030303), 4);
    const __m512i top1 = _mm512_slli_epi32(q_and(q_shr(a1, 6), 0x03030303), 4);
    const __m512i p[4] = {q_and(a0, 0x3f3f3f3f), _mm512_or_si512(q_and(a2, 0x0f0f0f0f), top0),
                          q_and(a1, 0x3f3f3f3f), _mm512_or_si512(q_and(q_shr(a2, 4), 0x0f0f0f0f), top1)};
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            _mm512_storeu_ps(sc[4 * v + i], _mm512_mul_ps(QF(q_and(q_shr(p[v], 8 * i), 255)), v < 2 ? d : dmin));
}

/* Q4_K (five 0) and Q5_K: sub-block s = 2c (low nibbles) and 2c + 1 (high) of the 32 bytes at qs + 32 c. A
 * sub-block's sixteen (Q5_K: 32) possible weights d sc q - dmin m, one FMA each (exact, as above), are a table, and
 * each weight is looked up by its code (vpermps uses an index's low four bits, vpermt2ps five: no masking): one
 * operation a sixteen values where converting and scaling took two. Q5_K's fifth bit of element l of sub-block s is
 * bit s of qh[l], rotated to bit 4 and selected in beside the nibble (one ternary op). */
static inline float q_dot_k(const uint8_t *row, long nb, const float *xr, const int bytes, const int five) {
    qf a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
    const __m512i c15 = _mm512_set1_epi32(15);
    const qf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const qf iota16 = _mm512_add_ps(iota, _mm512_set1_ps(16.0f));
    for (long j0 = 0; j0 < nb; j0 += 16) {
        const long np = nb - j0 < 16 ? nb - j0 : 16;
        float sc[16][16];
        q_k_scales16(row + (size_t)j0 * bytes, bytes, np, sc);
        for (long t = 0; t < np; t++) {
            const uint8_t *b = row + (size_t)(j0 + t) * bytes, *qs = b + (five ? 48 : 16);
            q_prefetch(b, bytes);
            const float *xb = xr + (size_t)(j0 + t) * 256;
            __m512i h[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            if (five) { h[0] = q_u8(b + 16); h[1] = q_u8(b + 32); }
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const int s = 2 * c;
                const qf t0 = QFMA(iota, QB(&sc[s][t]), QB(&sc[8 + s][t]));
                const qf t1 = QFMA(iota, QB(&sc[s + 1][t]), QB(&sc[9 + s][t]));
                qf u0 = t0, u1 = t1;
                if (five) {
                    u0 = QFMA(iota16, QB(&sc[s][t]), QB(&sc[8 + s][t]));
                    u1 = QFMA(iota16, QB(&sc[s + 1][t]), QB(&sc[9 + s][t]));
                }
#pragma GCC unroll 2
                for (int p = 0; p < 2; p++) {
                    const __m512i q = q_u8(qs + 32 * c + 16 * p);
                    qf lo, hi;
                    if (five) {     /* bits 2c and 2c + 1 of h[p] to bit 4: rotate right (by a vector of counts:
                                     * an immediate count is refused where the loop is not unrolled, at -O0) */
                        const __m512i r0 = _mm512_rorv_epi32(h[p], _mm512_set1_epi32((s - 4) & 31));
                        const __m512i r1 = _mm512_rorv_epi32(h[p], _mm512_set1_epi32((s - 3) & 31));
                        const __m512i i0 = _mm512_ternarylogic_epi32(q, r0, c15, 0xE4);        /* q & 15 | r0 & ~15 */
                        const __m512i i1 = _mm512_ternarylogic_epi32(q_shr(q, 4), r1, c15, 0xE4);
                        lo = _mm512_permutex2var_ps(t0, i0, u0);
                        hi = _mm512_permutex2var_ps(t1, i1, u1);
                    } else {
                        lo = _mm512_permutexvar_ps(q, t0);
                        hi = _mm512_permutexvar_ps(q_shr(q, 4), t1);
                    }
                    a[(4 * c + p) & 7] = QFMA(lo, QX(xb + 64 * c + 16 * p), a[(4 * c + p) & 7]);
                    a[(4 * c + 2 + p) & 7] = QFMA(hi, QX(xb + 64 * c + 32 + 16 * p), a[(4 * c + 2 + p) & 7]);
                }
            }
        }
    }
    return q_sum8(a);
}

static inline float dot_q4_k(const uint8_t *row, long nb, const float *x) { return q_dot_k(row, nb, x, 144, 0); }
static inline float dot_q5_k(const uint8_t *row, long nb, const float *x) { return q_dot_k(row, nb, x, 176, 1); }

/* Q6_K: each half's 128 six-bit codes are put together a whole register (64 bytes) at a time, before any widening:
 * bytes m of the half's 64 bytes of ql give elements m (low nibbles) and 64 + m (high), and the top two bits of
 * element e of the half are bits 2 (e / 32), +1 of qh[e % 32] (its 32 bytes read into both halves of the register),
 * moved to bits 4-5 by a 16-bit shift of its own for each half (the bits crossing from the next byte fall outside
 * 0x30); the 128 codes go through the stack and are widened sixteen at a time. Each 16 values have their scale d sc
 * and offset -32 d sc (read as broadcasts): w = d sc q - 32 d sc, one FMA of an exact value (as deq_q6_k). */
static inline float dot_q6_k(const uint8_t *row, long nb, const float *xr) {
    qf a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    const __m512i up_a = _mm512_setr_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                           0x0004000400040004, 0x0002000200020002, 0x0002000200020002,
                                           0x0002000200020002, 0x0002000200020002);   /* << 4 | << 2 */
    const __m512i down_b = _mm512_setr_epi64(0, 0, 0, 0, 0x0002000200020002, 0x0002000200020002,
                                             0x0002000200020002, 0x0002000200020002);  /* >> 0 | >> 2 */
    for (long j = 0; j < nb; j++) {
        const uint8_t *b = row + (size_t)j * 210;
        const float *xb = xr + (size_t)j * 256;
        q_prefetch(b, 210);
        float ds[16], dz[16];
        const qf scale = _mm512_mul_ps(QF(q_s8(b + 192)), _mm512_set1_ps(half(b + 208)));
        _mm512_storeu_ps(ds, scale);
        _mm512_storeu_ps(dz, _mm512_mul_ps(scale, _mm512_set1_ps(-32.0f)));
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            uint8_t q[128] __attribute__((aligned(64)));
            const __m512i ql = _mm512_loadu_si512(b + 64 * h);
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
            const __m512i ta = _mm512_and_si512(_mm512_sllv_epi16(qh, up_a), top2);
            const __m512i tb = _mm512_and_si512(_mm512_srlv_epi16(qh, down_b), top2);
            _mm512_store_si512(q, _mm512_ternarylogic_epi32(ql, lo4, ta, 0xEA));                 /* ql & 15 | ta */
            _mm512_store_si512(q + 64, _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), lo4, tb, 0xEA));
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const int i = 8 * h + g;
                a[i & 7] = QFMA(QFMA(QF(q_u8(q + 16 * g)), QB(ds + i), QB(dz + i)), QX(xb + 16 * i), a[i & 7]);
            }
        }
    }
    return q_sum8(a);
}
#else
QUANT_DOT(dot_q8_0, 32, 34, deq_q8_0)
QUANT_DOT(dot_q4_0, 32, 18, deq_q4_0)
QUANT_DOT(dot_q4_1, 32, 20, deq_q4_1)
QUANT_DOT(dot_q5_0, 32, 22, deq_q5_0)
QUANT_DOT(dot_q5_1, 32, 24, deq_q5_1)
QUANT_DOT(dot_q4_k, 256, 144, deq_q4_k)
QUANT_DOT(dot_q5_k, 256, 176, deq_q5_k)
QUANT_DOT(dot_q6_k, 256, 210, deq_q6_k)
#endif

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

/* Bytes of a block of the GGML type (a row of K values: K / q_block_values blocks), 0 for another type. */
static inline long q_block_bytes(int type) {
    switch (type) {
    case GGML_Q8_0: return 34; case GGML_Q4_0: return 18; case GGML_Q4_1: return 20; case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24; case GGML_Q4_K: return 144; case GGML_Q5_K: return 176; case GGML_Q6_K: return 210;
    default: return 0;
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
