/* The native decode steps' matrix products, one order of additions for a lone token and for a batch's rows
 * (batch invariance: a run's results are the same bit for bit whatever runs share its step).
 *
 * product (one row, decode.c's lone step) and product_rows (B rows, decode_rows.c's batched step) give each output
 * the same sum in the same order: the team's T threads split W's K rows into T contiguous shares of whole blocks of
 * eight rows (thread u: blocks G u / T .. G (u + 1) / T, G = K / 8); each thread's partial sum of a column runs over
 * its rows four at a time in float32, ((a0 w0 + a1 w1) + (a2 w2 + a3 w3)) added to it, eight at a time in 16 bits
 * (ROW8), starting from zero; the output is 0 + part_0 + part_1 + ... + part_{T-1}, added in thread order, then
 * rounded once to the type t. So a row's result depends on (K, N, T, t) alone, never on the batch's size or
 * composition, and never on the machine's load (static shares, no reduction order picked at run time).
 * product_rows reads each weight once from memory for all B rows (a span of columns of four of the thread's rows at a
 * time, from L1 for every row after the first), so that the batched step keeps its bandwidth.
 *
 * product and row_product_t are the lone step's (decode.c includes this file); product_rows the batched step's. */
#ifndef LLMI_ROW_PRODUCT_H
#define LLMI_ROW_PRODUCT_H

#include <omp.h>
#include <stddef.h>

#include "llama_ops.h"
#include "quant_ops.h"

/* acc[0:N] = x[k0:k1] @ W[k0:k1, :], W (K, N) row-major, as the model stores it (engine/weights.py: (in, out)): the
 * rows k0 .. k1 are one contiguous run of memory, taken four rows at a time (four streams a thread, which the hardware
 * prefetcher follows; the sums of the four rows are added before they reach acc, so acc, which stays in the L1 or L2
 * cache, is read and written once every four rows). The native step reads the model's own matrices: no second copy.
 * (Earlier the step read a copy laid out as panels of eight rows, the matrices' size again in memory; on the
 * bundled model's products the two ran within a few per cent of each other here.) */
LLMI_INLINE void row_product_t(const float *x, const void *W, int k0, int k1, int N, float *acc, const int t) {
    for (int n = 0; n < N; n++) acc[n] = 0.f;
    int k = k0;
    if (t == T_F32) {
        const float *Wf = W;
        for (; k + 4 <= k1; k += 4) {
            const float a0 = x[k], a1 = x[k + 1], a2 = x[k + 2], a3 = x[k + 3];
            const float *w0 = Wf + (size_t)k * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
#pragma omp simd
            for (int n = 0; n < N; n++) acc[n] += (a0 * w0[n] + a1 * w1[n]) + (a2 * w2[n] + a3 * w3[n]);
        }
    } else {
#define ROW8(L, w, n) ((a[0] * L(W, r + (n), t) + a[1] * L(W, r + w + (n), t)) \
                       + (a[2] * L(W, r + 2 * w + (n), t) + a[3] * L(W, r + 3 * w + (n), t))) \
                    + ((a[4] * L(W, r + 4 * w + (n), t) + a[5] * L(W, r + 5 * w + (n), t)) \
                       + (a[6] * L(W, r + 6 * w + (n), t) + a[7] * L(W, r + 7 * w + (n), t)))
        for (; k + 8 <= k1; k += 8) {
            const float *a = x + k;
            const size_t r = (size_t)k * N, w = (size_t)N;
            int n = 0;
            for (; n + 16 <= N; n += 16) *(v16 *)(acc + n) += ROW8(load16, w, n);
            if (n < N) *(v8 *)(acc + n) += ROW8(load8, w, n);
        }
    }
    for (; k < k1; k++) {
        const float a = x[k];
        const size_t r = (size_t)k * N;
#pragma omp simd
        for (int n = 0; n < N; n++) acc[n] += a * ld(W, r + n, t);
    }
}

static inline void row_product(const float *x, const void *W, int k0, int k1, int N, float *acc, int t) {
#define F(T) row_product_t(x, W, k0, k1, N, acc, T)
    BY_TYPE(t, F);
#undef F
}

/* out = x @ W, called by every thread of the team: each reads its share of W's rows (blocks of eight) once; each
 * output, the sum of the threads' partial sums, is rounded once to the type t (the PyTorch matmul's output dtype).
 * q != 0: W is N rows of K values in GGUF blocks of type q (float32 models only: step.py's refusal): each thread
 * takes a contiguous share of the N rows, each output one row's dot product with x, summed as quant.c's product of
 * one row of x sums it (the PyTorch forward's QuantMatrix.matmul at one token), so no partial sums are added. */
static inline void product(const float *x, const void *W, int K, int N, float *out, float *part, long stride, int t,
                           int q) {
    int u0 = omp_get_thread_num(), T = omp_get_num_threads(), G = K / 8;
    if (q) {
        const long nb = K / q_block_values(q);
        const int n0 = (int)((long)N * u0 / T), n1 = (int)((long)N * (u0 + 1) / T);
        for (int n = n0; n < n1; n++) out[n] = q_dot(q, W, n, nb, x);
#pragma omp barrier
        return;
    }
    int g0 = (int)((long)G * u0 / T), g1 = (int)((long)G * (u0 + 1) / T);
    row_product(x, W, 8 * g0, 8 * g1, N, part + (size_t)u0 * stride, t);
#pragma omp barrier
    const int n0 = (int)((long)N * u0 / T), n1 = (int)((long)N * (u0 + 1) / T);
    for (int n = n0; n < n1; n++) {
        float s = 0.f;
        for (int u = 0; u < T; u++) s += part[(size_t)u * stride + n];
        out[n] = s;
    }
    round_to(out + n0, n1 - n0, t);
#pragma omp barrier
}

enum { RP_SPAN = 128 };     /* columns a span: the B rows' sums of a span stay in L1 (30 rows: 15 KB) */

/* part[b * N + c0 .. + span) for b < B = x[b][k0:k1] @ W[k0:k1, c0 .. + span), span by span of RP_SPAN columns: the
 * sums kept in part itself (B spans: in L1), W read four (16 bits: eight) row spans at a time as row_product_t reads
 * its rows, each span of W used for all B rows while it is in L1, the span's rows two steps on asked for ahead. The
 * same operations in the same order as row_product_t, lane by lane. (A register tile of eight rows by sixteen
 * columns over all of k0 .. k1 walked W a line a row, which the hardware prefetcher follows badly: one thread's CPU
 * time for the bundled model's batched step, 1 / 8 / 30 rows: 168 / 172 / 330 ms, against 56 / 79 / 235 ms here and
 * 77 / 92 / 185 ms for the earlier kernel that summed in another order than the lone step.) */
LLMI_INLINE void rp_stream_t(const float *x, int B, const void *W, int Kd, int N, int k0, int k1, float *part,
                             const int t) {
    const size_t es = t == T_F32 ? 4 : 2;
    for (int c0 = 0; c0 < N; c0 += RP_SPAN) {
        const int span = N - c0 < RP_SPAN ? N - c0 : RP_SPAN;
        for (int b = 0; b < B; b++)
            for (int n = 0; n < span; n++) part[(size_t)b * N + c0 + n] = 0.f;
        if (t == T_F32) {
            const float *Wf = W;
            for (int k = k0; k + 4 <= k1; k += 4) {
                const float *w0 = Wf + (size_t)k * N + c0, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
                if (k + 12 <= k1)           /* the span's rows two steps on */
                    for (int j = 8; j < 12; j++)
                        for (int n = 0; n < span; n += 16) __builtin_prefetch(w0 + (size_t)j * N + n, 0, 3);
                for (int b = 0; b < B; b++) {
                    const float *a = x + (size_t)b * Kd;
                    const float a0 = a[k], a1 = a[k + 1], a2 = a[k + 2], a3 = a[k + 3];
                    float *acc = part + (size_t)b * N + c0;
#pragma omp simd
                    for (int n = 0; n < span; n++) acc[n] += (a0 * w0[n] + a1 * w1[n]) + (a2 * w2[n] + a3 * w3[n]);
                }
            }
        } else {
            for (int k = k0; k + 8 <= k1; k += 8) {
                const size_t r = (size_t)k * N + c0, w = (size_t)N;
                if (k + 24 <= k1)
                    for (int j = 16; j < 24; j++)
                        for (int n = 0; n < span; n += 32)
                            __builtin_prefetch((const char *)W + (r + (size_t)j * N + n) * es, 0, 3);
                for (int b = 0; b < B; b++) {
                    const float *a = x + (size_t)b * Kd + k;
                    float *acc = part + (size_t)b * N + c0;
                    int n = 0;
                    for (; n + 16 <= span; n += 16) *(v16 *)(acc + n) += ROW8(load16, w, n);
                    if (n < span) *(v8 *)(acc + n) += ROW8(load8, w, n);
                }
            }
        }
    }
}

#undef ROW8

/* out (B, N) = x (B, Kd) @ W (Kd, N) of type t, each row summed as product sums one (the file's comment); every
 * thread of the team calls it. part: (T, B, N) floats of scratch. */
LLMI_INLINE void product_rows_t(const float *x, int B, const void *W, int Kd, int N, float *out, float *part,
                                const int t) {
    const int u = omp_get_thread_num(), T = omp_get_num_threads(), G = Kd / 8;
    const int k0 = 8 * (int)((long)G * u / T), k1 = 8 * (int)((long)G * (u + 1) / T);
    float *pu = part + (size_t)u * B * N;
    rp_stream_t(x, B, W, Kd, N, k0, k1, pu, t);
#pragma omp barrier
    const int n0 = (int)((long)N * u / T), n1 = (int)((long)N * (u + 1) / T);
    for (int b = 0; b < B; b++) {
        float *o = out + (size_t)b * N;
        for (int n = n0; n < n1; n++) {
            float s = 0.f;
            for (int v = 0; v < T; v++) s += part[((size_t)v * B + b) * N + n];
            o[n] = s;
        }
        round_t(o + n0, n1 - n0, t);
    }
#pragma omp barrier
}

static void product_rows(const float *x, int B, const void *W, int Kd, int N, float *out, float *part, int t) {
#define F(T) product_rows_t(x, B, W, Kd, N, out, part, T)
    BY_TYPE(t, F);
#undef F
}

#endif
