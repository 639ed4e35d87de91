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
 * x stays fp32 here. llama.cpp's CPU kernels instead round x to 8 bits (q8_0 / q8_K blocks) and take integer dot
 * products (VNNI): less work a value, but a product that is no longer the fp32 product of the file's weights with x.
 * That arithmetic is quant_int8.h's (a type or-ed with Q_INT8: int8_rows below, load_model(quant="stored-int8")),
 * x rounded once a product, before the rows, here and in decode.c's step alike. With AVX-512 the row dot (each row of x past the last
 * tile of four, and decode.c's step) is quant_ops.h's written-out kernels (K-quant and 4-bit weights looked up in a
 * table of the sub-block's sixteen values, scales unpacked sixteen blocks at once); without it, the portable
 * decoders below (which the tiles of four rows of x use on every CPU). At B = 1 one core decodes (this machine,
 * 2026-12-07, 64 rows of 4,096 values in L2, the best of 3 x 200 passes) Q4_K 19, Q8_0 18, Q4_0/Q4_1 17, Q5_K 14,
 * Q5_0/Q5_1 13, Q6_K 13 billion values a second, against 12, 13, 15/14, 10, 11/11 and 10 for the portable kernels:
 * still bound by decoding, not by memory, on this machine's fast memory (engine/bench/quant_kernels.py). From memory
 * (quant_kernels --stream: the rows of a decode step) the row dots read ahead (quant_ops.h's q_prefetch): on two
 * threads Q4_K then streams 14.4 GB/s, Q8_0 17.9 (0.67, 0.84 of the fp32 kernel's 21.4), against 10.8 and 14.8 without.
 *
 * Rows are split between OpenMP threads (each thread a contiguous range: its own rows, its own dot products). A row
 * is read once for each tile of four of x's rows (a row of W is a few kB: the second tile finds it in L1/L2). */
#include <stdlib.h>

#include "quant_ops.h"
#include "quant_int8.h"

/* ---- the products: one function per format, its block decoder inlined ---- */

enum { TILE = 4 };       /* rows of x a dequantised block is multiplied with at once */

#define QUANT_ROWS(NAME, QK, BYTES, DEQ, DOT)                                                                        \
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
                    for (int i = 0; i < (QK) / 16; i++) acc[r] += v[i] * q_load16(xr + 16 * i);                  \
                }                                                                                              \
            }                                                                                                  \
            for (int r = 0; r < TILE; r++) y[(size_t)(b0 + r) * N + n] = q_hsum(acc[r]);                          \
        }                                                                                                      \
        for (; b0 < B; b0++)        /* one row of x: the dot product decode.c's step takes too */         \
            y[(size_t)b0 * N + n] = DOT(row, nb, x + (size_t)b0 * K);                                          \
    }                                                                                                          \
}

QUANT_ROWS(rows_q8_0, 32, 34, deq_q8_0, dot_q8_0)
QUANT_ROWS(rows_q4_0, 32, 18, deq_q4_0, dot_q4_0)
QUANT_ROWS(rows_q4_1, 32, 20, deq_q4_1, dot_q4_1)
QUANT_ROWS(rows_q5_0, 32, 22, deq_q5_0, dot_q5_0)
QUANT_ROWS(rows_q5_1, 32, 24, deq_q5_1, dot_q5_1)
QUANT_ROWS(rows_q4_k, 256, 144, deq_q4_k, dot_q4_k)
QUANT_ROWS(rows_q5_k, 256, 176, deq_q5_k, dot_q5_k)
QUANT_ROWS(rows_q6_k, 256, 210, deq_q6_k, dot_q6_k)

/* llama.cpp's arithmetic (quant_int8.h): each row of x rounded to 8 bits once, then every output one row dot, the
 * function decode.c's step calls (so a row's result does not depend on B, nor on the threads). -3: no memory. */
static int int8_rows(int type, const uint8_t *w, long N, long K, const float *x, long B, float *y, int nth) {
    if (!q8_has(type)) return -1;
    const long qk = q_block_values(type), xb = q8_x_bytes(type, K);
    if (K % qk) return -2;
    uint8_t *xq = malloc((size_t)(B * xb + 64));
    if (!xq) return -3;
    for (long b = 0; b < B; b++) q8_round(type, x + (size_t)b * K, K, xq + (size_t)b * xb);
    const long nb = K / qk;
#pragma omp parallel for schedule(static) num_threads(nth)
    for (long n = 0; n < N; n++)
        for (long b = 0; b < B; b++) y[(size_t)b * N + n] = q8_dot(type, w, n, nb, xq + (size_t)b * xb);
    free(xq);
    return 0;
}

/* x (K values) rounded as the weight type's int8 product rounds it (quant_int8.h's layout) into out
 * (llmi_quant_x_bytes bytes), for the tests' comparison with engine/quant_int8.py; -1 for a type without it. */
long llmi_quant_x_bytes(int type, long K) { return q8_has(type) ? q8_x_bytes(type, K) : -1; }

int llmi_quant_x(int type, const float *x, long K, uint8_t *out) {
    if (!q8_has(type) || K % q_block_values(type)) return -1;
    q8_round(type, x, K, out);
    return 0;
}

/* y (B, N) = x (B, K) @ W^T for W (N, K) in GGML type `type` (its number in the file), x and y contiguous fp32.
 * type | Q_INT8: in llama.cpp's arithmetic (int8_rows).
 * 0, or -1 for a type this file does not implement, -2 for a K that is not a whole number of its blocks, -3 for no
 * memory. */
int llmi_quant_rows(int type, const uint8_t *w, long N, long K, const float *x, long B, float *y, int nth) {
    if (type & Q_INT8) return int8_rows(type & ~Q_INT8, w, N, K, x, B, y, nth < 1 ? 1 : nth);
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
                for (int i = 0; i < 4; i++) a[i] += q_load16(row + k + 16 * i) * q_load16(xr + k + 16 * i);
            }
            for (; k + 16 <= K; k += 16) a[0] += q_load16(row + k) * q_load16(xr + k);
            float s = q_hsum((a[0] + a[1]) + (a[2] + a[3]));
            for (; k < K; k++) s += row[k] * xr[k];
            y[(size_t)b * N + n] = s;
        }
    }
}
