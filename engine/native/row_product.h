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
 * product_rows reads each weight once for all B rows (a chunk of columns of the thread's rows, from cache for every
 * block of eight rows after the first), and keeps a tile of up to eight rows' sums in registers over the
 * thread's rows, so that the batched step keeps its bandwidth.
 *
 * row_product_t and product are decode.c's (copied here unchanged, for decode.c to include in place of its own). */
#ifndef LLMI_ROW_PRODUCT_H
#define LLMI_ROW_PRODUCT_H

#include <omp.h>
#include <stddef.h>

#include "llama_ops.h"
#include "quant_ops.h"

/* acc[0:N] = x[k0:k1] @ W[k0:k1, :], W (K, N) row-major (decode.c's, unchanged) */
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

/* out = x @ W, called by every thread of the team (decode.c's, unchanged; q != 0: W in GGUF blocks of type q) */
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

enum { RP_ROWS = 8, RP_CHUNK = 128 };    /* rows a register tile holds; columns a chunk (its weights stay in L2) */

/* part[i * N + n .. + V) for rows i < R = x[i][k0:k1] @ W[k0:k1, n .. n + V), V = 16 (VT v16) or 8 (v8): each sum
 * held in a register over the rows k0 .. k1, added to in row_product_t's order (a column's sum there is the same
 * sequence of the same operations, lane by lane). pf: NULL, or the weights to ask for with each group of rows (the
 * next columns, so that reading memory and multiplying overlap). Inlined with R, VT and t constant. */
#define RP_TILE(NAME, VT, LOAD)                                                                                       \
LLMI_INLINE void NAME(const int R, const int t, const float *x, int Kd, const void *W, int N, int n, int k0, int k1, \
                      float *part, const char *pf, size_t es) {                                                      \
    VT acc[RP_ROWS];                                                                                                  \
    for (int i = 0; i < R; i++) acc[i] = (VT){0};                                                                     \
    if (t == T_F32) {                                                                                                 \
        for (int k = k0; k + 4 <= k1; k += 4) {                                                                       \
            const size_t r = (size_t)k * N + n;                                                                       \
            if (pf) for (int j = 0; j < 4; j++) __builtin_prefetch(pf + (size_t)(k + j) * N * es, 0, 3);              \
            const VT w0 = LOAD(W, r, t), w1 = LOAD(W, r + N, t), w2 = LOAD(W, r + 2 * (size_t)N, t),                  \
                     w3 = LOAD(W, r + 3 * (size_t)N, t);                                                              \
            for (int i = 0; i < R; i++) {                                                                             \
                const float *a = x + (size_t)i * Kd + k;                                                              \
                acc[i] += (a[0] * w0 + a[1] * w1) + (a[2] * w2 + a[3] * w3);                                          \
            }                                                                                                         \
        }                                                                                                             \
    } else {                                                                                                          \
        for (int k = k0; k + 8 <= k1; k += 8) {                                                                       \
            const size_t r = (size_t)k * N + n, w = (size_t)N;                                                        \
            if (pf) for (int j = 0; j < 8; j++) __builtin_prefetch(pf + (size_t)(k + j) * N * es, 0, 3);              \
            const VT l0 = LOAD(W, r, t), l1 = LOAD(W, r + w, t), l2 = LOAD(W, r + 2 * w, t),                          \
                     l3 = LOAD(W, r + 3 * w, t), l4 = LOAD(W, r + 4 * w, t), l5 = LOAD(W, r + 5 * w, t),              \
                     l6 = LOAD(W, r + 6 * w, t), l7 = LOAD(W, r + 7 * w, t);                                          \
            for (int i = 0; i < R; i++) {                                                                             \
                const float *a = x + (size_t)i * Kd + k;                                                              \
                acc[i] += ((a[0] * l0 + a[1] * l1) + (a[2] * l2 + a[3] * l3))                                         \
                          + ((a[4] * l4 + a[5] * l5) + (a[6] * l6 + a[7] * l7));                                      \
            }                                                                                                         \
        }                                                                                                             \
    }                                                                                                                 \
    for (int i = 0; i < R; i++) *(VT *)(part + (size_t)i * N + n) = acc[i];                                           \
}
RP_TILE(rp_tile16, v16, load16)
RP_TILE(rp_tile8, v8, load8)
#undef RP_TILE

#define RP_CASES(F, ...) switch (R) { \
    case 8: F(8, __VA_ARGS__); break; case 7: F(7, __VA_ARGS__); break; case 6: F(6, __VA_ARGS__); break; \
    case 5: F(5, __VA_ARGS__); break; case 4: F(4, __VA_ARGS__); break; case 3: F(3, __VA_ARGS__); break; \
    case 2: F(2, __VA_ARGS__); break; default: F(1, __VA_ARGS__); }

/* out (B, N) = x (B, Kd) @ W (Kd, N) of type t, each row summed as product sums one (the file's comment); every
 * thread of the team calls it. part: (T, B, N) floats of scratch. */
LLMI_INLINE void product_rows_t(const float *x, int B, const void *W, int Kd, int N, float *out, float *part,
                                const int t) {
    const int u = omp_get_thread_num(), T = omp_get_num_threads(), G = Kd / 8;
    const int k0 = 8 * (int)((long)G * u / T), k1 = 8 * (int)((long)G * (u + 1) / T);
    const size_t es = t == T_F32 ? 4 : 2;
    float *pu = part + (size_t)u * B * N;
    for (int c0 = 0; c0 < N; c0 += RP_CHUNK) {
        const int c1 = c0 + RP_CHUNK < N ? c0 + RP_CHUNK : N;
        for (int r0 = 0; r0 < B; r0 += RP_ROWS) {
            const int R = B - r0 < RP_ROWS ? B - r0 : RP_ROWS;
            const float *xr = x + (size_t)r0 * Kd;
            float *pr = pu + (size_t)r0 * N;
            for (int n = c0; n < c1; n += 16) {
                /* the first row block asks for the columns four tiles on (the next chunk's at a chunk's end) */
                const char *pf = r0 == 0 && n + 64 < N ? (const char *)W + ((size_t)k0 * N + n + 64) * es : NULL;
                if (n + 16 <= c1) {
#define F(RR, TT) rp_tile16(RR, TT, xr, Kd, W, N, n, k0, k1, pr, pf, es)
                    RP_CASES(F, t)
#undef F
                } else {
#define F(RR, TT) rp_tile8(RR, TT, xr, Kd, W, N, n, k0, k1, pr, pf, es)
                    RP_CASES(F, t)
#undef F
                }
            }
        }
    }
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
