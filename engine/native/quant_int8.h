/* llama.cpp's arithmetic for a GGUF matrix kept in its blocks (load_model(quant="stored-int8")): x is rounded to
 * 8 bits once a product, as llama.cpp's CPU backend rounds it (ggml-cpu's quantize_row_q8_K, quantize_row_q8_0,
 * quantize_row_q8_1), and each block's product with it is an integer dot product (AVX-512 VNNI vpdpbusd / vpdpwssd),
 * scaled in float32 by the two blocks' scales, as ggml_vec_dot_q4_K_q8_K, _q8_0_q8_0 and _q4_1_q8_1 take it.
 * quant_ops.h's float kernels (quant="stored") multiply the file's exact weights with an fp32 x instead; this is the
 * product llama.cpp computes, about as fast as the memory allows. Measured here (2026-12-07, two threads, load 3.8,
 * engine/bench/quant_kernels.py --stream, the float kernel and this one in alternation on the same copies): of the
 * fp32 floor (10.7 GB/s), Q4_K 0.70 -> 0.89, Q8_0 0.92 -> 1.00, Q4_1 0.71 -> 0.78; the 8B-shaped Q4_K file decoded
 * natively (scripts/bench_int8.py, load 4.5) 1.64 -> 2.35 tokens a second, 0.55 -> 0.79 of its floor.
 *
 * A GGML type or-ed with Q_INT8 selects it: quant.c's product (the PyTorch forward's QuantMatrix.matmul) and
 * row_product.h's product (decode.c's lone step) both take the code engine/native/quant.py makes, and both call
 * q8_dot below, so the two compute each output the same way bit for bit.
 *
 * x rounded, for K values (the layouts are this file's own, the values llama.cpp's):
 *   Q8_K (for Q4_K), 256 a block:  float d[nb]; int16 bsums[nb][16]; int8 q[K]     (36 nb + K bytes)
 *       max = the value of largest magnitude (the first of them), iscale = -127 / max, q = min(127, nearest(iscale
 *       x)) (x iscale rounded to float, then to the nearest integer, ties to even), d = 1 / iscale, bsums: each 16
 *       q's sum (in order); a block of zeros: d = 0, q = 0. A block's eight runs of 32 q are stored in the order
 *       0 2 1 3 4 6 5 7 (Q8K_SLOT), the order 64 bytes of Q4_K nibbles give them in (low: 0, 2; high: 1, 3).
 *   Q8_0 (for Q8_0) and Q8_1 (for Q4_1), 32 a block: float d[nb + 16]; float s[nb + 16]; int8 q[K + 64]
 *       amax = max |x|, d = fp16(amax / 127), q = nearest(x (127 / amax)) (0 where amax is 0), ties to even (x86's
 *       _mm256_round_ps); Q8_1's s = fp16((amax / 127) sum q) (llama.cpp's unrounded d). d and s hold the fp16
 *       values as floats; the padding (16 lanes of d, s; 64 bytes of q) is zeros, read by whole vectors.
 * A row dot is then, per block, an integer (exact: no sum here leaves 2^24) times fl(d_w d_x), plus for Q4_K
 * -fl(d_x dmin_w) m_s (bsums of s) for each sub-block s, for Q4_1 m_w s_x: summed in float32 (the order is this
 * file's: 16 lanes of partial integer sums each scaled and added, as llama.cpp's 8). engine/quant_int8.py is the
 * reference. */
#ifndef LLMI_QUANT_INT8_H
#define LLMI_QUANT_INT8_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_ops.h"

enum { Q_INT8 = 0x100 };     /* or-ed into a GGML type: the product in llama.cpp's arithmetic */

/* 1 where this file multiplies the type (the GGML type without Q_INT8) with a rounded x */
static inline int q8_has(int type) { return type == GGML_Q4_K || type == GGML_Q8_0 || type == GGML_Q4_1; }

/* bytes of a rounded x of K values for the weight type (q8_has) */
static inline long q8_x_bytes(int type, long K) {
    return type == GGML_Q4_K ? 36 * (K / 256) + K : 8 * (K / 32 + 16) + K + 64;
}

/* the slot a Q8_K block's run s of 32 q is stored in (its own inverse: 1 and 2, 5 and 6 swap) */
static inline int q8k_slot(int s) { return (s & 4) | ((s & 1) << 1) | ((s & 2) >> 1); }

static inline float q8_fp16(float f) { return (float)(_Float16)f; }     /* to the nearest half, ties to even */

/* quantize_row_q8_K_ref: nearest(iscale x) is rintf of the product rounded to float (not a fused multiply-add) */
static inline void q8_round_k(const float *x, long K, uint8_t *out) {
    const long nb = K / 256;
    float *d = (float *)out;
    int16_t *bs = (int16_t *)(out + 4 * nb);
    int8_t *q = (int8_t *)(out + 36 * nb);
    for (long i = 0; i < nb; i++) {
        const float *xb = x + i * 256;
        float amax = 0.f, max = 0.f;
        for (int j = 0; j < 256; j++) {
            const float ax = fabsf(xb[j]);
            if (ax > amax) { amax = ax; max = xb[j]; }
        }
        int8_t *qb = q + i * 256;
        if (amax == 0.f) {
            d[i] = 0.f;
            memset(qb, 0, 256);
            memset(bs + i * 16, 0, 32);
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < 256; j++) {
            const float p = iscale * xb[j];
            const int v = (int)rintf(p);
            qb[32 * q8k_slot(j / 32) + j % 32] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += qb[32 * q8k_slot(g / 2) + 16 * (g % 2) + l];
            bs[i * 16 + g] = (int16_t)s;
        }
        d[i] = 1.f / iscale;
    }
}

/* x86's quantize_row_q8_0 (with_s 0) and quantize_row_q8_1 (with_s 1) */
static inline void q8_round_32(const float *x, long K, uint8_t *out, int with_s) {
    const long nb = K / 32;
    float *d = (float *)out, *s = d + nb + 16;
    int8_t *q = (int8_t *)(s + nb + 16);
    memset(out, 0, (size_t)q8_x_bytes(GGML_Q8_0, K));
    for (long i = 0; i < nb; i++) {
        const float *xb = x + i * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        const float dd = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            const float p = xb[j] * id;
            const int v = (int)rintf(p);
            q[i * 32 + j] = (int8_t)(v > 127 ? 127 : v < -128 ? -128 : v);
            sum += q[i * 32 + j];
        }
        d[i] = q8_fp16(dd);
        if (with_s) s[i] = q8_fp16(dd * (float)sum);
    }
}

static inline void q8_round(int type, const float *x, long K, uint8_t *out) {
    if (type == GGML_Q4_K) q8_round_k(x, K, out);
    else q8_round_32(x, K, out, type == GGML_Q4_1);
}

/* Q4_K's eight 6-bit scales (sc) and mins (m) of a super-block, llama.cpp's unpacking of the twelve bytes */
static inline void q8_k4_scales(const uint8_t *b, uint8_t sc[8], uint8_t m[8]) {
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t aux = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = aux;
    u[0] &= 0x3f3f3f3fu;
    memcpy(sc, u, 8);
    memcpy(m, u + 2, 8);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Q4_K x Q8_K: each 128 values (64 bytes of nibbles: the low ones sub-blocks 4h and 4h + 2, the high ones 4h + 1 and
 * 4h + 3, x's runs stored in that order) two vpmaddubsw (nibble x int8 pairs, at most 2 15 127 in 16 bits) and two
 * vpdpwssd (those pairs times their sub-block's scale, into 32-bit lanes); the super-block's 16 lanes (each below
 * 2^21) converted and scaled by fl(d_x d_w) into float lanes. The mins' eight products m_s (bsums 2s + 2s + 1) are
 * one vpmaddwd, scaled by -fl(d_x dmin) into eight float lanes of their own (llama.cpp's four). The scales stay in
 * registers: built in memory and read back as one word, they stalled every super-block on a failed store-to-load
 * forward. */
static inline float dot8_q4_k(const uint8_t *row, long nb, const uint8_t *xq) {
    const float *xd = (const float *)xq;
    const int16_t *bs = (const int16_t *)(xq + 4 * nb);
    const int8_t *q8 = (const int8_t *)(xq + 36 * nb);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i pick[4];       /* [h][low, high]: words 0-15 sub-block a's scale, 16-31 sub-block a + 2's */
    for (int i = 0; i < 4; i++) {
        const int a = 4 * (i / 2) + (i % 2);
        pick[i] = _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16((short)a), _mm512_set1_epi16((short)(a + 2)));
    }
    __m512 acc = _mm512_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
    for (long t = 0; t < nb; t++) {
        const uint8_t *b = row + (size_t)t * 144, *qs = b + 16;
        q_prefetch(b, 144);
        uint32_t u0, u1, u2;                            /* llama.cpp's unpacking of the twelve bytes (q8_k4_scales) */
        memcpy(&u0, b + 4, 4);
        memcpy(&u1, b + 8, 4);
        memcpy(&u2, b + 12, 4);
        const uint32_t s0 = u0 & 0x3f3f3f3fu, s1 = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
        const uint32_t n0 = u1 & 0x3f3f3f3fu, n1 = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
        const __m128i sc = _mm_cvtsi64_si128((long long)((uint64_t)s1 << 32 | s0));
        const __m128i mn = _mm_cvtsi64_si128((long long)((uint64_t)n1 << 32 | n0));
        const __m512i scw = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(sc));
        const __m256i mins = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs + 16 * t)),
                                               _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn, mn)));
        __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i q = _mm512_loadu_si512(qs + 64 * h);
            const __m512i lo = _mm512_maddubs_epi16(_mm512_and_si512(q, m4),
                                                    _mm512_loadu_si512(q8 + 256 * t + 128 * h));
            const __m512i hi = _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(q, 4), m4),
                                                    _mm512_loadu_si512(q8 + 256 * t + 128 * h + 64));
            isum = _mm512_dpwssd_epi32(isum, lo, _mm512_permutexvar_epi16(pick[2 * h], scw));
            isum = _mm512_dpwssd_epi32(isum, hi, _mm512_permutexvar_epi16(pick[2 * h + 1], scw));
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(xd[t] * half(b)), _mm512_cvtepi32_ps(isum), acc);
        accm = _mm256_fmadd_ps(_mm256_set1_ps(-xd[t] * half(b + 2)), _mm256_cvtepi32_ps(mins), accm);
    }
    const __m128 m2 = _mm_add_ps(_mm256_castps256_ps128(accm), _mm256_extractf128_ps(accm, 1));
    return _mm512_reduce_add_ps(acc) + (m2[0] + m2[1] + (m2[2] + m2[3]));
}

/* Q8_0 x Q8_0 and Q4_1 x Q8_1: two blocks a register (64 values), vpdpbusd's four-value sums in 16 lanes, scaled
 * by the two blocks' fl(d_w d_x) (sixteen blocks' scales gathered at once, quant_ops.h's q_scales16). Q8_0's signed
 * weights as llama.cpp's: |w| (unsigned) times x with w's sign. */
#define Q8_DOT32(NAME, BYTES, FOUR)                                                                             \
static inline float NAME(const uint8_t *row, long nb, const uint8_t *xq) {                                     \
    const float *xd = (const float *)xq, *xs = xd + nb + 16;                                                   \
    const int8_t *q8 = (const int8_t *)(xs + nb + 16);                                                         \
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};      \
    __m512 accm = _mm512_setzero_ps();                                                                         \
    const __m512i z = _mm512_setzero_si512();                                                                  \
    (void)accm; (void)xs;                                                                                      \
    for (long j = 0; j < nb; j += 16) {                                                                        \
        const uint8_t *b0 = row + (size_t)j * (BYTES);                                                         \
        const long n = nb - j < 16 ? nb - j : 16;                                                              \
        q_prefetch(b0, 16 * (BYTES));                                                                          \
        float dw[16] = {0}, mw[16] = {0};                                                                      \
        q_scales16(b0, BYTES, n, dw, FOUR ? mw : 0);                                                           \
        const __m512 dd = _mm512_mul_ps(_mm512_loadu_ps(dw), _mm512_loadu_ps(xd + j));                         \
        if (FOUR) accm = _mm512_fmadd_ps(_mm512_loadu_ps(mw), _mm512_loadu_ps(xs + j), accm);                  \
        _Pragma("GCC unroll 8")                                                                                \
        for (int p = 0; p < 8; p++) {                                                                          \
            if (2 * p < n) {                                                                                   \
                const uint8_t *b = b0 + 2 * p * (BYTES);                                                       \
                const int two = 2 * p + 1 < n;                                                                 \
                __m512i w;                                                                                     \
                if (FOUR) {                                                                                    \
                    const __m128i m4 = _mm_set1_epi8(0x0f), a = _mm_loadu_si128((const __m128i *)(b + 4));      \
                    const __m128i c = two ? _mm_loadu_si128((const __m128i *)(b + (BYTES) + 4)) : _mm_setzero_si128(); \
                    const __m256i h0 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(a, m4)),  \
                                                               _mm_and_si128(_mm_srli_epi16(a, 4), m4), 1);   \
                    const __m256i h1 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(c, m4)),  \
                                                               _mm_and_si128(_mm_srli_epi16(c, 4), m4), 1);   \
                    w = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);                                 \
                } else {                                                                                       \
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(b + 2));                            \
                    const __m256i c = two ? _mm256_loadu_si256((const __m256i *)(b + (BYTES) + 2))              \
                                          : _mm256_setzero_si256();                                            \
                    w = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);                                   \
                }                                                                                              \
                __m512i x = _mm512_loadu_si512(q8 + (size_t)(j + 2 * p) * 32);                                 \
                if (!FOUR) {                                                                                   \
                    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), z, x);                                 \
                    w = _mm512_abs_epi8(w);                                                                    \
                }                                                                                              \
                const __m512i s = _mm512_dpbusd_epi32(z, w, x);                                                \
                const __m512 dv = _mm512_permutexvar_ps(                                                       \
                    _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(2 * p), _mm512_set1_epi32(2 * p + 1)), dd); \
                acc[p & 3] = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(s), acc[p & 3]);                           \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])))  \
           + (FOUR ? _mm512_reduce_add_ps(accm) : 0.f);                                                        \
}
Q8_DOT32(dot8_q8_0, 34, 0)
Q8_DOT32(dot8_q4_1, 20, 1)
#undef Q8_DOT32
#else
/* without AVX-512 VNNI: the same integers block by block (Q4_K's mins sub-block by sub-block), scaled, added in
 * order */
static inline float dot8_q4_k(const uint8_t *row, long nb, const uint8_t *xq) {
    const float *xd = (const float *)xq;
    const int16_t *bs = (const int16_t *)(xq + 4 * nb);
    const int8_t *q8 = (const int8_t *)(xq + 36 * nb);
    float sum = 0.f;
    for (long t = 0; t < nb; t++) {
        const uint8_t *b = row + (size_t)t * 144, *qs = b + 16;
        uint8_t sc[8], m[8];
        q8_k4_scales(b, sc, m);
        int isum = 0;
        for (int s = 0; s < 8; s++) {
            int v = 0;
            for (int l = 0; l < 32; l++)
                v += ((qs[32 * (s / 2) + l] >> (4 * (s & 1))) & 15) * q8[256 * t + 32 * q8k_slot(s) + l];
            isum += sc[s] * v;
        }
        sum += (xd[t] * half(b)) * (float)isum;
        for (int s = 0; s < 8; s++)
            sum += (-xd[t] * half(b + 2)) * (float)(m[s] * (bs[t * 16 + 2 * s] + bs[t * 16 + 2 * s + 1]));
    }
    return sum;
}

/* not vectorised: GCC 12 (-O3, AVX-VNNI without AVX-512 VNNI) turns this int8 x int8 sum into vpdpbusd, whose first
 * operand is unsigned, and gets it wrong (checked here with -mno-avx512vnni: -14.36 for 3.66) */
__attribute__((optimize("no-tree-vectorize")))
static inline float dot8_q8_0(const uint8_t *row, long nb, const uint8_t *xq) {
    const float *xd = (const float *)xq;
    const int8_t *q8 = (const int8_t *)(xq + 8 * (nb + 16));
    float sum = 0.f;
    for (long u = 0; u < nb; u++) {
        const uint8_t *b = row + (size_t)u * 34;
        int v = 0;
        for (int l = 0; l < 32; l++) v += (int8_t)b[2 + l] * q8[32 * u + l];
        sum += (half(b) * xd[u]) * (float)v;
    }
    return sum;
}

static inline float dot8_q4_1(const uint8_t *row, long nb, const uint8_t *xq) {
    const float *xd = (const float *)xq, *xs = xd + nb + 16;
    const int8_t *q8 = (const int8_t *)(xs + nb + 16);
    float sum = 0.f;
    for (long u = 0; u < nb; u++) {
        const uint8_t *b = row + (size_t)u * 20;
        int v = 0;
        for (int l = 0; l < 16; l++) v += (b[4 + l] & 15) * q8[32 * u + l] + (b[4 + l] >> 4) * q8[32 * u + 16 + l];
        sum += (half(b) * xd[u]) * (float)v + half(b + 2) * xs[u];
    }
    return sum;
}
#endif

/* W's row n (nb blocks) dot the rounded x, for a type q8_has admits */
static inline float q8_dot(int type, const uint8_t *w, long n, long nb, const uint8_t *xq) {
    switch (type) {
    case GGML_Q4_K: return dot8_q4_k(w + (size_t)n * nb * 144, nb, xq);
    case GGML_Q8_0: return dot8_q8_0(w + (size_t)n * nb * 34, nb, xq);
    default:        return dot8_q4_1(w + (size_t)n * nb * 20, nb, xq);
    }
}

#endif
