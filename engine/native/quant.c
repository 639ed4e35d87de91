/* Products with a GGUF matrix kept in its quantised blocks (engine/quant_matrix.py): y (B, N) = x (B, K) @ W^T, W
 * (N, K) stored as GGUF stores it, each of its N rows K / block values in the file's own bytes. A block is turned into
 * its fp32 values in vector registers (2 vectors of 16, 16 for a K-quant super-block) and multiplied with x there, as
 * llama.cpp's dequantising kernels do, so W is read once, in its stored size, and never held in fp32.
 *
 * The block layouts are gguf-py's gguf/quants.py (and llama.cpp's ggml-quants.c), little-endian:
 *   Q8_0  34 B / 32: fp16 d, 32 int8 q                                   w = d q
 *   Q4_0  18 B / 32: fp16 d, 16 B nibbles (low: elements 0-15, high 16-31)  w = d (q - 8)
 *   Q4_1  20 B / 32: fp16 d, fp16 m, 16 B nibbles                         w = d q + m
 *   Q5_0  22 B / 32: fp16 d, u32 qh (bit i: element i's fifth bit), 16 B nibbles      w = d (q - 16)
 *   Q5_1  24 B / 32: fp16 d, fp16 m, u32 qh, 16 B nibbles                 w = d q + m
 *   Q4_K 144 B / 256: fp16 d, fp16 dmin, 12 B of 6-bit scales and mins of 8 sub-blocks of 32, 128 B nibbles (32
 *                     bytes give sub-blocks 2c (low) and 2c+1 (high))     w = (d sc_s) q - dmin m_s
 *   Q5_K 176 B / 256: as Q4_K, then 32 B qh (bit s of byte l: sub-block s's element l's fifth bit), 128 B nibbles
 *   Q6_K 210 B / 256: 128 B ql, 64 B qh (2 bits each), 16 int8 scales (one per 16 values), fp16 d
 *                                                                         w = (d sc) (q - 32)
 * Every value is exact in fp32 (an fp16 scale has 11 significant bits, a sub-block scale at most 7, a code at most 6:
 * 24 bits at most; d q + m is one rounding of an exact product), so however it is computed here (one FMA) the weights
 * the kernel multiplies are gguf.quants.dequantize's bit for bit (tests/unit/test_quant_matrix.py multiplies the
 * identity); only the sums' order differs from a plain loop (fp32, FMA, 16 lanes, four sums for one row of x).
 *
 * x stays fp32. llama.cpp's CPU kernels instead round x to 8 bits (q8_0 / q8_K blocks) and take integer dot products
 * (VNNI): about 2-4 times less work a value, but a product that is no longer the fp32 product of the file's weights
 * with x, so it is not done here. At B = 1 these kernels decode about 10^10 values a second a core (this machine,
 * 2026-12-07): memory-bound where the memory is slow, compute-bound where it is fast (engine/bench/quant_kernels.py).
 *
 * Rows are split between OpenMP threads (each thread a contiguous range: its own rows, its own dot products). A row
 * is read once for each tile of four of x's rows (a row of W is a few kB: the second tile finds it in L1/L2). */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float qv16 __attribute__((vector_size(64), aligned(4)));     /* sixteen floats, unaligned loads */

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13,
       GGML_Q6_K = 14 };
enum { TILE = 4 };       /* rows of x a dequantised block is multiplied with at once */

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

static inline qv16 load16(const float *p) { return *(const qv16 *)p; }

/* The sixteen lanes' sum, pairwise (four dependent adds instead of fifteen at the end of every row). */
static inline float hsum(qv16 v) {
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

/* ---- the products: one function per format, its block decoder inlined ---- */

/* Values the one-row loop decodes a step: two 32-value blocks or one K-quant super-block, sixteen vectors or four */
#define STEP(QK) ((QK) >= 64 ? (QK) : 64)

#define QUANT_ROWS(NAME, QK, BYTES, DEQ)                                                                        \
static void NAME(const uint8_t *w, long N, long K, const float *x, long B, float *y, int nth) {                \
    const long nb = K / (QK);                                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(nth)")                                              \
    for (long n = 0; n < N; n++) {                                                                             \
        const uint8_t *row = w + (size_t)n * nb * (BYTES);                                                     \
        long b0 = 0;                                                                                           \
        for (; b0 + TILE <= B; b0 += TILE) {                                                                   \
            qv16 acc[TILE] = {{0}};                                                                             \
            for (long j = 0; j < nb; j++) {                                                                    \
                qv16 v[(QK) / 16];                                                                             \
                DEQ(row + (size_t)j * (BYTES), v);                                                             \
                _Pragma("GCC unroll 4")                                                                        \
                for (int r = 0; r < TILE; r++) {                                                               \
                    const float *xr = x + (size_t)(b0 + r) * K + (size_t)j * (QK);                             \
                    _Pragma("GCC unroll 16")                                                                   \
                    for (int i = 0; i < (QK) / 16; i++) acc[r] += v[i] * load16(xr + 16 * i);                  \
                }                                                                                              \
            }                                                                                                  \
            for (int r = 0; r < TILE; r++) y[(size_t)(b0 + r) * N + n] = hsum(acc[r]);                          \
        }                                                                                                      \
        for (; b0 < B; b0++) {      /* one row of x: four sums, so that four multiply-adds are in flight */    \
            qv16 a[4] = {{0}};                                                                                 \
            const float *xr = x + (size_t)b0 * K;                                                              \
            long j = 0;                                                                                        \
            for (; j + STEP(QK) / (QK) <= nb; j += STEP(QK) / (QK)) {                                                  \
                qv16 v[STEP(QK) / 16];                                                                             \
                for (int u = 0; u < STEP(QK) / (QK); u++) DEQ(row + (size_t)(j + u) * (BYTES), v + u * (QK) / 16); \
                _Pragma("GCC unroll 16")                                                                       \
                for (int i = 0; i < STEP(QK) / 16; i++) a[i & 3] += v[i] * load16(xr + (size_t)j * (QK) + 16 * i); \
            }                                                                                                  \
            for (; j < nb; j++) {                                                                              \
                qv16 v[(QK) / 16];                                                                             \
                DEQ(row + (size_t)j * (BYTES), v);                                                             \
                for (int i = 0; i < (QK) / 16; i++) a[i & 3] += v[i] * load16(xr + (size_t)j * (QK) + 16 * i); \
            }                                                                                                  \
            y[(size_t)b0 * N + n] = hsum((a[0] + a[1]) + (a[2] + a[3]));                                       \
        }                                                                                                      \
    }                                                                                                          \
}

QUANT_ROWS(rows_q8_0, 32, 34, deq_q8_0)
QUANT_ROWS(rows_q4_0, 32, 18, deq_q4_0)
QUANT_ROWS(rows_q4_1, 32, 20, deq_q4_1)
QUANT_ROWS(rows_q5_0, 32, 22, deq_q5_0)
QUANT_ROWS(rows_q5_1, 32, 24, deq_q5_1)
QUANT_ROWS(rows_q4_k, 256, 144, deq_q4_k)
QUANT_ROWS(rows_q5_k, 256, 176, deq_q5_k)
QUANT_ROWS(rows_q6_k, 256, 210, deq_q6_k)

/* y (B, N) = x (B, K) @ W^T for W (N, K) in GGML type `type` (its number in the file), x and y contiguous fp32.
 * 0, or -1 for a type this file does not implement, -2 for a K that is not a whole number of its blocks. */
int llmi_quant_rows(int type, const uint8_t *w, long N, long K, const float *x, long B, float *y, int nth) {
    typedef void (*rows_fn)(const uint8_t *, long, long, const float *, long, float *, int);
    rows_fn f;
    long qk = 32;
    switch (type) {
    case GGML_Q8_0: f = rows_q8_0; break;
    case GGML_Q4_0: f = rows_q4_0; break;
    case GGML_Q4_1: f = rows_q4_1; break;
    case GGML_Q5_0: f = rows_q5_0; break;
    case GGML_Q5_1: f = rows_q5_1; break;
    case GGML_Q4_K: f = rows_q4_k; qk = 256; break;
    case GGML_Q5_K: f = rows_q5_k; qk = 256; break;
    case GGML_Q6_K: f = rows_q6_k; qk = 256; break;
    default: return -1;
    }
    if (K % qk) return -2;
    f(w, N, K, x, B, y, nth < 1 ? 1 : nth);
    return 0;
}

/* The same product for an fp32 W (N, K): the memory floor the quantised kernels are measured against (the bench,
 * engine/bench/quant_kernels.py): the same split of rows, the same sums, no decoding. */
void llmi_f32_rows(const float *w, long N, long K, const float *x, long B, float *y, int nth) {
#pragma omp parallel for schedule(static) num_threads(nth < 1 ? 1 : nth)
    for (long n = 0; n < N; n++) {
        const float *row = w + (size_t)n * K;
        for (long b = 0; b < B; b++) {
            const float *xr = x + (size_t)b * K;
            qv16 a[4] = {{0}};
            long k = 0;
            for (; k + 64 <= K; k += 64) {
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) a[i] += load16(row + k + 16 * i) * load16(xr + k + 16 * i);
            }
            for (; k + 16 <= K; k += 16) a[0] += load16(row + k) * load16(xr + k);
            float s = hsum((a[0] + a[1]) + (a[2] + a[3]));
            for (; k < K; k++) s += row[k] * xr[k];
            y[(size_t)b * N + n] = s;
        }
    }
}
