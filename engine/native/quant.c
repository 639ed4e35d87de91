/* Products with a GGUF matrix kept in its quantised blocks (engine/quant_matrix.py): y (B, N) = x (B, K) @ W^T, W
 * (N, K) stored as GGUF stores it, each of its N rows K / block values in the file's own bytes. A block is turned into
 * its fp32 values on the stack (32 values, 256 for the K-quants: they stay in L1) and multiplied with x there, as
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
 * Every value is computed as gguf-py computes it, and each is exact in fp32 whatever the order (an fp16 scale has 11
 * significant bits, a sub-block scale at most 7, a code at most 6: 24 bits at most), so the weights the kernel
 * multiplies are gguf.quants.dequantize's bit for bit; only the sums' order differs (fp32, FMA, 16 lanes).
 *
 * Rows are split between OpenMP threads (each thread a contiguous range: its own rows, its own dot products). A row
 * is read once for each tile of four of x's rows (a row of W is a few kB: the second tile finds it in L1/L2). */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
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

static inline float hsum(qv16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* ---- one block's values, in order ---- */

static inline void deq_q8_0(const uint8_t *b, float *o) {
    const float d = half(b);
    for (int i = 0; i < 32; i++) o[i] = d * (float)(int8_t)b[2 + i];
}

static inline void deq_q4_0(const uint8_t *b, float *o) {
    const float d = half(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)((qs[j] & 15) - 8);
        o[j + 16] = d * (float)((qs[j] >> 4) - 8);
    }
}

static inline void deq_q4_1(const uint8_t *b, float *o) {
    const float d = half(b), m = half(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)(qs[j] & 15) + m;
        o[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

static inline void deq_q5_0(const uint8_t *b, float *o) {
    const float d = half(b);
    const uint32_t qh = le32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)((int)((qs[j] & 15) | ((qh >> j) & 1) << 4) - 16);
        o[j + 16] = d * (float)((int)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
    }
}

static inline void deq_q5_1(const uint8_t *b, float *o) {
    const float d = half(b), m = half(b + 2);
    const uint32_t qh = le32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)((qs[j] & 15) | ((qh >> j) & 1) << 4) + m;
        o[j + 16] = d * (float)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
    }
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

static inline void deq_q4_k(const uint8_t *b, float *o) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *scales = b + 4, *qs = b + 16;
    for (int c = 0; c < 4; c++, qs += 32, o += 64) {
        float s0, m0, s1, m1;
        scale_min(2 * c, scales, &s0, &m0);
        scale_min(2 * c + 1, scales, &s1, &m1);
        const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
        for (int l = 0; l < 32; l++) {
            o[l] = d0 * (float)(qs[l] & 15) - n0;
            o[l + 32] = d1 * (float)(qs[l] >> 4) - n1;
        }
    }
}

static inline void deq_q5_k(const uint8_t *b, float *o) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; c++, qs += 32, o += 64) {
        float s0, m0, s1, m1;
        scale_min(2 * c, scales, &s0, &m0);
        scale_min(2 * c + 1, scales, &s1, &m1);
        const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
        for (int l = 0; l < 32; l++) {
            o[l] = d0 * (float)((qs[l] & 15) | ((qh[l] >> (2 * c)) & 1) << 4) - n0;
            o[l + 32] = d1 * (float)((qs[l] >> 4) | ((qh[l] >> (2 * c + 1)) & 1) << 4) - n1;
        }
    }
}

static inline void deq_q6_k(const uint8_t *b, float *o) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half(b + 208);
    for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, o += 128) {
        for (int s = 0; s < 4; s++) {            /* element 32 s + l of this half of 128 */
            const uint8_t *lo = ql + 32 * (s & 1);
            const int shift = s >= 2 ? 4 : 0;
            const float d0 = d * (float)sc[2 * s], d1 = d * (float)sc[2 * s + 1];
            for (int l = 0; l < 32; l++) {
                const int q = (int)(((lo[l] >> shift) & 15) | ((qh[l] >> (2 * s)) & 3) << 4) - 32;
                o[32 * s + l] = (l < 16 ? d0 : d1) * (float)q;
            }
        }
    }
}

/* ---- the products: one function per format, its block decoder inlined ---- */

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
                float v[QK];                                                                                   \
                DEQ(row + (size_t)j * (BYTES), v);                                                             \
                for (int r = 0; r < TILE; r++) {                                                               \
                    const float *xr = x + (size_t)(b0 + r) * K + (size_t)j * (QK);                             \
                    for (int i = 0; i < (QK); i += 16) acc[r] += load16(v + i) * load16(xr + i);               \
                }                                                                                              \
            }                                                                                                  \
            for (int r = 0; r < TILE; r++) y[(size_t)(b0 + r) * N + n] = hsum(acc[r]);                          \
        }                                                                                                      \
        for (; b0 < B; b0++) {           /* one row of x: two sums, so that two multiply-adds are in flight */ \
            qv16 a0 = {0}, a1 = {0};                                                                           \
            const float *xr = x + (size_t)b0 * K;                                                              \
            for (long j = 0; j < nb; j++, xr += (QK)) {                                                        \
                float v[QK];                                                                                   \
                DEQ(row + (size_t)j * (BYTES), v);                                                             \
                for (int i = 0; i < (QK); i += 32) {                                                           \
                    a0 += load16(v + i) * load16(xr + i);                                                      \
                    a1 += load16(v + i + 16) * load16(xr + i + 16);                                            \
                }                                                                                              \
            }                                                                                                  \
            y[(size_t)b0 * N + n] = hsum(a0 + a1);                                                             \
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
            qv16 a0 = {0}, a1 = {0};
            long k = 0;
            for (; k + 32 <= K; k += 32) {
                a0 += load16(row + k) * load16(xr + k);
                a1 += load16(row + k + 16) * load16(xr + k + 16);
            }
            float s = hsum(a0 + a1);
            for (; k < K; k++) s += row[k] * xr[k];
            y[(size_t)b * N + n] = s;
        }
    }
}
