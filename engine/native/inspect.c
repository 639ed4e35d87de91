/* Statistics for a multi-token forward (prefill, full inspection) in one pass each, beside the PyTorch forward.
 * Python: engine/native/inspect.py. Both fall back to the PyTorch code (engine/stats.py,
 * engine/attention_stats.py) when the library is missing, and that code stays the reference in the tests.
 *
 * llmi_row_stats_many: the seven statistics of every row of several stage tensors in one call.
 * llmi_attention_stats: the statistics of a causal layer's attention scores and pattern per query row, over
 * (heads × keys), without materialising them: each row's scores are computed into a per-thread buffer of S
 * floats, reduced, turned into the pattern and reduced again. Masked scores (-inf) are left out of the
 * scores' statistics; the pattern's masked entries are zeros and count, as in the materialised tensors.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>

#include "rowstat.h"
#include "vexp.h"

/* Several tensors in one call (one parallel region): desc[6 i ...] = address, T, G, n, st, sg of tensor i;
 * out: the (T_i, 7) blocks one after another; bad: one flag a row, in the same order, 1 where the row holds a NaN
 * or Inf (a row at a time: its statistics do not depend on the rows beside it, batch invariance). */
void llmi_row_stats_many(int count, const long *desc, float *out, int *bad, int nth) {
    long rows = 0;
    for (int i = 0; i < count; i++) rows += desc[6 * i + 1];
    for (long r = 0; r < rows; r++) bad[r] = 0;
#pragma omp parallel num_threads(nth) if (rows > 1)
    {
        long at = 0;
        for (int i = 0; i < count; i++) {
            const long *d = desc + 6 * i;
            const float *x = (const float *)d[0];
            const int T = (int)d[1], G = (int)d[2], n = (int)d[3];
#pragma omp for schedule(static) nowait
            for (int t = 0; t < T; t++)
                if (row_stat(x + (long)t * d[4], G, n, d[5], out + (at + t) * NSTAT)) bad[at + t] = 1;
            at += T;
        }
    }
}

enum { ROWS = 4, LANES = 16 };

long llmi_attention_work_floats(int H, int K, int T, int S, int hd, int nth) {
    const long Sp = (S + LANES - 1) / LANES * LANES;
    return (long)K * hd * Sp + (long)nth * ROWS * Sp + 2L * 8 * H * T + 64;
}

/* q: (H, T, hd) at q[h * qh + t * qt + i]; keys: (K, S, hd) at k[j * kh + s * ks + i]; query t sees keys
 * s <= off + t. out_scores, out_pattern: (T, 7) or NULL. work: llmi_attention_work_floats() floats.
 * Work items are (head, four query rows): their scores against the keys they see are a small matrix product
 * (four rows by eight keys a step, the keys laid out in panels of eight once per call), then each row is reduced, exponentiated
 * and reduced again into per-(head, row) partials, which are combined over heads at the end.
 * Returns 1 if a score or a value (v: (K, S, hd) at v[j * vh + s * vs + i]) is not finite (the caller takes
 * the exact PyTorch path), else 0: then every query, key and value is finite (each key meets the last row). */
int llmi_attention_stats(int H, int K, int T, int S, int hd, int off, float scale, const float *q, long qh,
                         long qt, const float *k, long kh, long ks, const float *v, long vh, long vs,
                         float *out_scores, float *out_pattern, float *work, int nth) {
    const int G = H / K, blocks = (T + ROWS - 1) / ROWS;
    const long Sp = (S + LANES - 1) / LANES * LANES;
    float *kT = work, *scratch = kT + (long)K * hd * Sp;
    double *part = (double *)(((size_t)(scratch + (long)nth * ROWS * Sp) + 63) & ~(size_t)63);   /* (H, T, 8) */
    int bad = 0;
#pragma omp parallel num_threads(nth) reduction(| : bad)
    {
#pragma omp for schedule(static)
        for (int j = 0; j < K; j++) {     /* keys in panels of LANES: kT[j][s / LANES][i][s % LANES] */
            for (int s = 0; s < (int)Sp; s++)
                for (int i = 0; i < hd; i++)
                    kT[(long)j * hd * Sp + ((long)(s / LANES) * hd + i) * LANES + s % LANES] =
                        s < S ? k[(long)j * kh + (long)s * ks + i] : 0.f;
            float acc[LANES] = {0};       /* and the values checked finite (the caller's fused kernel needs it) */
            for (int s = 0; s < S; s++) {
                const float *vv = v + (long)j * vh + (long)s * vs;
                for (int i = 0; i < hd; i++) acc[i % LANES] += vv[i];
            }
            float sum = 0.f;
            for (int c = 0; c < LANES; c++) sum += acc[c];
            if (!isfinite(sum)) bad = 1;
        }
        float *sc = scratch + (size_t)omp_get_thread_num() * ROWS * Sp;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < H * blocks; item++) {
            const int h = item / blocks, t0 = (blocks - 1 - item % blocks) * ROWS;   /* long rows first */
            const int rows = T - t0 < ROWS ? T - t0 : ROWS;
            const int last = off + t0 + rows < S ? off + t0 + rows : S;             /* keys the block sees */
            const float *kt = kT + (long)(h / G) * hd * Sp;
            const float *qr[ROWS];
            for (int r = 0; r < ROWS; r++) qr[r] = q + (long)h * qh + (long)(t0 + (r < rows ? r : 0)) * qt;
            for (int j = 0; j < last; j += LANES) {
                float acc[ROWS][LANES] = {{0}};
                const float *kp = kt + (long)(j / LANES) * hd * LANES;
                for (int i = 0; i < hd; i++) {
                    const float *kv = kp + (long)i * LANES;
                    for (int r = 0; r < ROWS; r++) {
                        const float b = qr[r][i];
#pragma omp simd
                        for (int c = 0; c < LANES; c++) acc[r][c] += b * kv[c];
                    }
                }
                for (int r = 0; r < ROWS; r++)
#pragma omp simd
                    for (int c = 0; c < LANES; c++) sc[(long)r * Sp + j + c] = acc[r][c] * scale;
            }
            for (int r = 0; r < rows; r++) {
                float *row = sc + (long)r * Sp;
                const int n = off + t0 + r + 1 < S ? off + t0 + r + 1 : S;         /* keys this row sees */
                float lo = INFINITY, hi = -INFINITY, s1 = 0.f, s2 = 0.f;
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(+ : s1, s2)
                for (int s = 0; s < n; s++) {
                    const float v = row[s];
                    lo = v < lo ? v : lo;
                    hi = v > hi ? v : hi;
                    s1 += v;
                    s2 += v * v;
                }
                if (!isfinite(s1) || !isfinite(s2)) {
                    bad = 1;
                    continue;
                }
                float l = 0.f;
#pragma omp simd reduction(+ : l)
                for (int s = 0; s < n; s++) l += (row[s] = exp_le0(row[s] - hi));
                const float inv = 1.f / l;
                float plo = INFINITY, p1 = 0.f, p2 = 0.f;
#pragma omp simd reduction(min : plo) reduction(+ : p1, p2)
                for (int s = 0; s < n; s++) {
                    const float p = row[s] * inv;
                    plo = p < plo ? p : plo;
                    p1 += p;
                    p2 += p * p;
                }
                double *o = part + ((long)h * T + t0 + r) * 8;
                o[0] = lo, o[1] = hi, o[2] = s1, o[3] = s2, o[4] = n < S ? 0.0 : plo, o[5] = inv, o[6] = p1, o[7] = p2;
            }
        }
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const int n = off + t + 1 < S ? off + t + 1 : S;
            double lo = INFINITY, hi = -INFINITY, s1 = 0, s2 = 0, plo = INFINITY, phi = -INFINITY, p1 = 0, p2 = 0;
            for (int h = 0; h < H; h++) {
                const double *o = part + ((long)h * T + t) * 8;
                lo = o[0] < lo ? o[0] : lo;
                hi = o[1] > hi ? o[1] : hi;
                s1 += o[2], s2 += o[3];
                plo = o[4] < plo ? o[4] : plo;
                phi = o[5] > phi ? o[5] : phi;                   /* the row's largest p: e^0 / l */
                p1 += o[6], p2 += o[7];
            }
            if (out_scores) {
                const double cnt = (double)H * n, mean = s1 / cnt, var = s2 / cnt - mean * mean;
                float *w = out_scores + (long)t * NSTAT;
                w[0] = (float)lo, w[1] = (float)hi, w[2] = (float)mean, w[3] = (float)sqrt(var > 0 ? var : 0);
                w[4] = (float)(fabs(lo) > fabs(hi) ? fabs(lo) : fabs(hi)), w[5] = w[6] = 0.f;
            }
            if (out_pattern) {
                const double cnt = (double)H * S, mean = p1 / cnt, var = p2 / cnt - mean * mean;
                float *w = out_pattern + (long)t * NSTAT;
                w[0] = (float)plo, w[1] = (float)phi, w[2] = (float)mean, w[3] = (float)sqrt(var > 0 ? var : 0);
                w[4] = (float)(fabs(plo) > fabs(phi) ? fabs(plo) : fabs(phi)), w[5] = w[6] = 0.f;
            }
        }
    }
    return bad;
}
