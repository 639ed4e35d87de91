/* The native decode steps' matrix products, one order of additions for a lone token and for a batch's rows
 * (batch invariance: a run's results are the same bit for bit whatever runs share its step).
 *
 * product (one row, decode.c's lone step) and product_rows (B rows, decode_rows.c's batched step) give each output
 * the same sum in the same order: the team's T threads split W's K rows into T contiguous shares of whole blocks of
 * eight rows (thread u: blocks G u / T .. G (u + 1) / T, G = K / 8; the last thread also the K % 8 rows past them:
 * row_share); each thread's partial sum of a column runs over its rows four at a time in float32, ((a0 w0 + a1 w1) +
 * (a2 w2 + a3 w3)) added to it, eight at a time in 16 bits (ROW8), then the rows left one at a time (a0 w0 added),
 * starting from zero; any N: a column past the vectors' last sixteen or eight (GPT-2's 50,257) is the same sum
 * computed one lane wide; the output is 0 + part_0 + part_1 + ... + part_{T-1}, added in thread order, then
 * rounded once to the type t. So a row's result depends on (K, N, T, t) alone, never on the batch's size or
 * composition, and never on the machine's load (static shares, no reduction order picked at run time).
 * product_rows reads each weight once from memory for all B rows (a tile of the thread's rows loaded into registers
 * once, each row's sums added to it: the blocking's comment below), so that the batched step keeps its bandwidth.
 *
 * product and row_product_t are the lone step's (decode.c includes this file); product_rows the batched step's. */
#ifndef LLMI_ROW_PRODUCT_H
#define LLMI_ROW_PRODUCT_H

#include <omp.h>
#include <stddef.h>

#include "llama_ops.h"
#include "quant_ops.h"
#include "quant_int8.h"

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
            if (n + 8 <= N) *(v8 *)(acc + n) += ROW8(load8, w, n), n += 8;
            for (; n < N; n++) acc[n] += ROW8(ld, w, n);     /* a tail of 1-7 columns (GPT-2's 50,257) */
        }
    }
    for (; k < k1; k++) {
        const float a = x[k];
        const size_t r = (size_t)k * N;
#pragma omp simd
        for (int n = 0; n < N; n++) acc[n] += a * ld(W, r + n, t);
    }
}

/* thread u's share of W's K rows, [*k0, *k1): whole blocks of eight, G u / T .. G (u + 1) / T of the G = K / 8; the
 * last thread also takes the K % 8 rows past the last block (summed one at a time, after its blocks: row_product_t),
 * the same share in product, product_bias (decode.c) and product_rows */
static inline void row_share(int K, int u, int T, int *k0, int *k1) {
    const int G = K / 8;
    *k0 = 8 * (int)((long)G * u / T);
    *k1 = u == T - 1 ? K : 8 * (int)((long)G * (u + 1) / T);
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
 * one row of x sums it (the PyTorch forward's QuantMatrix.matmul at one token), so no partial sums are added. q with
 * Q_INT8: the same rows in llama.cpp's arithmetic (quant_int8.h: x rounded to 8 bits, integer dots), as quant.c's. */
static inline void product(const float *x, const void *W, int K, int N, float *out, float *part, long stride, int t,
                           int q) {
    int u0 = omp_get_thread_num(), T = omp_get_num_threads(), k0, k1;
    if (q) {
        const int type = q & ~Q_INT8;
        const long nb = K / q_block_values(type);
        const int n0 = (int)((long)N * u0 / T), n1 = (int)((long)N * (u0 + 1) / T);
        if (q & Q_INT8) {       /* llama.cpp's arithmetic (quant_int8.h): each thread rounds x itself, into its own
                                 * share of part (unused on this path; llmi_work_floats leaves room: d + 64 floats) */
            uint8_t *xq = (uint8_t *)(part + (size_t)u0 * stride);
            q8_round(type, x, K, xq);
            for (int n = n0; n < n1; n++) out[n] = q8_dot(type, W, n, nb, xq);
        } else {
            for (int n = n0; n < n1; n++) out[n] = q_dot(q, W, n, nb, x);
        }
#pragma omp barrier
        return;
    }
    row_share(K, u0, T, &k0, &k1);
    row_product(x, W, k0, k1, N, part + (size_t)u0 * stride, t);
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

/* The batched product's blocking (product_rows). Each thread sums its share of W's rows for all B rows span by span
 * of columns, the B rows' sums of a span in a block of its own (blk: B x span floats, rows 64-byte aligned) that stays
 * in the L1 cache (RP_L1 bytes), then copied to part. (Summing into part's rows directly, B rows N floats apart, put
 * every row's span in the same cache sets at N = 3072 or 49,152 and split vectors across cache lines: 1.5-2 times
 * slower.) A span is as wide as the block leaves room for (one row: 6,144 columns; 30 rows: 192), whole tiles of
 * RP_TILE columns, so that a run of a row of W is long at few rows, for the hardware prefetcher; short runs (many rows)
 * are asked for two groups ahead. Each weight, once loaded into a register, serves all B rows: a tile of four (16
 * bits: eight) of W's rows by RP_TILE columns is loaded once (converted once, in 16 bits) and each row's sums added to
 * it. One thread's CPU time for the bundled model's products at 1 / 2 / 8 / 30 rows (a C harness on the model's
 * shapes, 2 threads, this machine, 2026-12-07, load average 5-8): float32 23 / 24 / 38 / 77 ms against 26 / 30 / 46
 * / 124 ms for the earlier kernel (a span's four rows reloaded from L1 for each row, the sums in part's rows),
 * bfloat16 16-19 / 17-20 / 30 / 66-79 against 17 / 24 / 56 / 176; in alternation at load average 8-12 (all
 * slower), float32 109 / 146 / 109 / 203 against 138 / 167 / 188 / 300.
 *
 * The order of operations is row_product_t's, lane by lane: each group is the same expression (RP_GROUP4 is
 * row_product_t's sum of four rows; RP_GROUP8, and two RP_GROUP4s added, ROW8's tree), added to a sum that starts
 * from zero, in k order. GCC contracts each pair of products the same way in both (-O3 -march=native: GNU C's
 * -ffp-contract=fast; a1 w1 rounded, a0 w0 fused into it by one FMA, as the generated code shows), because the
 * expressions are the same; tests/unit/test_product_rows.py holds every row to the lone product bit for bit at
 * shapes that reach every tail. */
enum { RP_TILE = 32, RP_L1 = 24576, RP_ROWS = 32, RP_AHEAD = 2048 };   /* RP_AHEAD: bytes of a row's run */

LLMI_INLINE int rp_span(int B, int N) {
    int s = RP_L1 / (4 * (B < RP_ROWS ? B : RP_ROWS)) / RP_TILE * RP_TILE;
    if (s < 2 * RP_TILE) s = 2 * RP_TILE;
    return s < N ? s : N;
}

/* one group's sum of a row: a (x[b][k ..]) times four vectors of W's rows k .. k + 3; in 16 bits, eight rows of W
 * from element r (row k, column n) at column offset o, each converted by L (load16 / load8) */
#define RP_GROUP4(a, w0, w1, w2, w3) (((a)[0] * (w0) + (a)[1] * (w1)) + ((a)[2] * (w2) + (a)[3] * (w3)))
#define RP_GROUP8(a, L, o) (((a[0] * L(W, r + (o), t) + a[1] * L(W, r + N + (o), t)) \
                             + (a[2] * L(W, r + 2 * N + (o), t) + a[3] * L(W, r + 3 * N + (o), t))) \
                            + ((a[4] * L(W, r + 4 * N + (o), t) + a[5] * L(W, r + 5 * N + (o), t)) \
                               + (a[6] * L(W, r + 6 * N + (o), t) + a[7] * L(W, r + 7 * N + (o), t))))

/* part[b * N + c] for rows b0 .. b0 + nb (nb <= RP_ROWS), all columns c = x[b][k0:k1] @ W[k0:k1, c], span by span */
LLMI_INLINE void rp_stream_t(const float *x, int b0, int nb, int B, const void *W, int Kd, int N, int k0, int k1,
                             float *part, const int t) {
    const int S = rp_span(B, N), step = t == T_F32 ? 4 : 8;
    const size_t es = t == T_F32 ? 4 : 2;
    float xa[RP_ROWS * 8] __attribute__((aligned(64)));
    float blk[RP_L1 / 4] __attribute__((aligned(64)));     /* the span's sums, row b at blk + b span */
    for (int c0 = 0; c0 < N; c0 += S) {
        const int span = N - c0 < S ? N - c0 : S, ls = (span + 15) & ~15;     /* blk's row stride: aligned */
        for (int i = 0; i < nb * ls; i++) blk[i] = 0.f;
        for (int k = k0; k + step <= k1; k += step) {
            for (int b = 0; b < nb; b++)        /* the group's x, rows side by side (x's rows may share cache sets) */
                for (int j = 0; j < step; j++) xa[b * 8 + j] = x[(size_t)(b0 + b) * Kd + k + j];
            const size_t r0 = (size_t)k * N + c0;
            if (span * (int)es <= RP_AHEAD && k + 3 * step <= k1)    /* short runs: two groups on, ahead */
                for (int j = 2 * step; j < 3 * step; j++)
                    for (int n = 0; n < span; n += 64 / (int)es)
                        __builtin_prefetch((const char *)W + (r0 + (size_t)j * N + n) * es, 0, 3);
            for (int n = 0; n < span; n += RP_TILE) {
                const int w = span - n < RP_TILE ? span - n : RP_TILE;
                const size_t r = r0 + n;
                float *acc = blk + n;
                if (t == T_F32 && w == RP_TILE) {
                    const float *p = (const float *)W + r;
                    const v16 w0 = *(const v16 *)p, w1 = *(const v16 *)(p + N), w2 = *(const v16 *)(p + 2 * N),
                              w3 = *(const v16 *)(p + 3 * N), y0 = *(const v16 *)(p + 16),
                              y1 = *(const v16 *)(p + N + 16), y2 = *(const v16 *)(p + 2 * N + 16),
                              y3 = *(const v16 *)(p + 3 * N + 16);
                    for (int b = 0; b < nb; b++) {
                        const float *a = xa + b * 8;
                        float *o = acc + (size_t)b * ls;
                        *(v16 *)o += RP_GROUP4(a, w0, w1, w2, w3);
                        *(v16 *)(o + 16) += RP_GROUP4(a, y0, y1, y2, y3);
                    }
                } else if (t == T_F32) {
                    const float *p = (const float *)W + r;
                    for (int b = 0; b < nb; b++) {
                        const float *a = xa + b * 8;
                        float *o = acc + (size_t)b * ls;
#pragma omp simd
                        for (int c = 0; c < w; c++) o[c] += RP_GROUP4(a, p[c], p[N + c], p[2 * N + c], p[3 * N + c]);
                    }
                } else if (w == RP_TILE) {
                    const v16 g0 = load16(W, r, t), g1 = load16(W, r + N, t), g2 = load16(W, r + 2 * (size_t)N, t),
                              g3 = load16(W, r + 3 * (size_t)N, t), g4 = load16(W, r + 4 * (size_t)N, t),
                              g5 = load16(W, r + 5 * (size_t)N, t), g6 = load16(W, r + 6 * (size_t)N, t),
                              g7 = load16(W, r + 7 * (size_t)N, t);
                    for (int b = 0; b < nb; b++) {
                        const float *a = xa + b * 8;
                        *(v16 *)(acc + (size_t)b * ls) +=
                            RP_GROUP4(a, g0, g1, g2, g3) + RP_GROUP4(a + 4, g4, g5, g6, g7);
                    }
                    const v16 h0 = load16(W, r + 16, t), h1 = load16(W, r + N + 16, t),
                              h2 = load16(W, r + 2 * (size_t)N + 16, t), h3 = load16(W, r + 3 * (size_t)N + 16, t),
                              h4 = load16(W, r + 4 * (size_t)N + 16, t), h5 = load16(W, r + 5 * (size_t)N + 16, t),
                              h6 = load16(W, r + 6 * (size_t)N + 16, t), h7 = load16(W, r + 7 * (size_t)N + 16, t);
                    for (int b = 0; b < nb; b++) {
                        const float *a = xa + b * 8;
                        *(v16 *)(acc + (size_t)b * ls + 16) +=
                            RP_GROUP4(a, h0, h1, h2, h3) + RP_GROUP4(a + 4, h4, h5, h6, h7);
                    }
                } else {
                    for (int b = 0; b < nb; b++) {
                        const float *a = xa + b * 8;
                        float *o = acc + (size_t)b * ls;
                        int c = 0;
                        for (; c + 16 <= w; c += 16) *(v16 *)(o + c) += RP_GROUP8(a, load16, c);
                        if (c + 8 <= w) *(v8 *)(o + c) += RP_GROUP8(a, load8, c), c += 8;
                        for (; c < w; c++) o[c] += RP_GROUP8(a, ld, c);
                    }
                }
            }
        }
        /* the last share's rows past its groups (K not a multiple of eight): one row at a time, as row_product_t */
        for (int k = k0 + (k1 - k0) / step * step; k < k1; k++)
            for (int b = 0; b < nb; b++) {
                const float a = x[(size_t)(b0 + b) * Kd + k];
                const size_t r = (size_t)k * N + c0;
                float *o = blk + (size_t)b * ls;
#pragma omp simd
                for (int n = 0; n < span; n++) o[n] += a * ld(W, r + n, t);
            }
        for (int b = 0; b < nb; b++)
            for (int n = 0; n < span; n++) part[(size_t)(b0 + b) * N + c0 + n] = blk[(size_t)b * ls + n];
    }
}

#undef RP_GROUP8
#undef RP_GROUP4
#undef ROW8

/* out (B, N) = x (B, Kd) @ W (Kd, N) of type t, each row summed as product sums one (the file's comment); every
 * thread of the team calls it. part: (T, B, N) floats of scratch. */
LLMI_INLINE void product_rows_t(const float *x, int B, const void *W, int Kd, int N, float *out, float *part,
                                const int t) {
    const int u = omp_get_thread_num(), T = omp_get_num_threads();
    int k0, k1;
    row_share(Kd, u, T, &k0, &k1);
    for (int b0 = 0; b0 < B; b0 += RP_ROWS)
        rp_stream_t(x, b0, B - b0 < RP_ROWS ? B - b0 : RP_ROWS, B, W, Kd, N, k0, k1, part + (size_t)u * B * N, t);
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
