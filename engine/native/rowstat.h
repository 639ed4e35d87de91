/* The seven statistics of one row, shared by decode.c (each stage of a decode step) and inspect.c. */
#ifndef LLMI_ROWSTAT_H
#define LLMI_ROWSTAT_H
#include <math.h>

enum { NSTAT = 7 };

typedef float rs_v16 __attribute__((vector_size(64), aligned(4)));      /* sixteen floats, unaligned */

typedef int rs_i16 __attribute__((vector_size(64), aligned(4)));

static inline rs_v16 rs_pick(rs_i16 m, rs_v16 a, rs_v16 b) {     /* lane by lane: m ? a : b */
    return (rs_v16)(((rs_i16)a & m) | ((rs_i16)b & ~m));
}

static inline float rs_sum(rs_v16 a) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += a[i];
    return s;
}

/* The seven statistics (min, max, mean, std (population, two-pass), absmax, nan, inf) of row t of a tensor
 * whose element (t, g, i) is at x[t * st + g * sg + i], read while the row is in cache. Returns 1 if the row
 * holds a NaN or Inf (the caller then takes the PyTorch path, whose accounting of them is the reference). Each pass
 * keeps two 16-wide vectors of partial sums (and of minima and maxima) over all of the row's groups, reduced once at
 * the end: 32 independent chains, where one 8-wide chain of additions a group, bound by their latency, read 2.6 G
 * values a second on this 2-core machine. Not inlined: its callers are many, and one call a row costs nothing
 * beside its passes (inlined at each of them, the library took twice as long to build). */
static __attribute__((noinline, unused)) int row_stat(const float *x, int G, int n, long sg, float *o) {
    rs_v16 a0 = {0}, a1 = {0}, mn0, mn1, mx0, mx1;
    for (int j = 0; j < 16; j++) mn0[j] = mn1[j] = INFINITY, mx0[j] = mx1[j] = -INFINITY;
    double tail = 0.0;
    float lo = INFINITY, hi = -INFINITY;
    for (int g = 0; g < G; g++) {
        const float *r = x + (long)g * sg;
        int i = 0;
        for (; i + 32 <= n; i += 32) {
            const rs_v16 v0 = *(const rs_v16 *)(r + i), v1 = *(const rs_v16 *)(r + i + 16);
            a0 += v0, a1 += v1;
            mn0 = rs_pick(v0 < mn0, v0, mn0), mn1 = rs_pick(v1 < mn1, v1, mn1);
            mx0 = rs_pick(v0 > mx0, v0, mx0), mx1 = rs_pick(v1 > mx1, v1, mx1);
        }
        for (; i < n; i++) {
            const float v = r[i];
            tail += v, lo = v < lo ? v : lo, hi = v > hi ? v : hi;
        }
    }
    for (int j = 0; j < 16; j++) {
        const float m = mn0[j] < mn1[j] ? mn0[j] : mn1[j], M = mx0[j] > mx1[j] ? mx0[j] : mx1[j];
        lo = m < lo ? m : lo, hi = M > hi ? M : hi;
    }
    const double s = (double)rs_sum(a0 + a1) + tail;
    if (!isfinite(s)) return 1;
    const float m = (float)(s / ((double)G * n));
    rs_v16 q0 = {0}, q1 = {0};
    double q = 0.0;
    for (int g = 0; g < G; g++) {
        const float *r = x + (long)g * sg;
        int i = 0;
        for (; i + 32 <= n; i += 32) {
            const rs_v16 e0 = *(const rs_v16 *)(r + i) - m, e1 = *(const rs_v16 *)(r + i + 16) - m;
            q0 += e0 * e0, q1 += e1 * e1;
        }
        for (; i < n; i++) {
            const float e = r[i] - m;
            q += e * e;
        }
    }
    q += rs_sum(q0 + q1);
    o[0] = lo, o[1] = hi, o[2] = m, o[3] = (float)sqrt(q / ((double)G * n));
    o[4] = fabsf(lo) > fabsf(hi) ? fabsf(lo) : fabsf(hi), o[5] = o[6] = 0.f;
    return 0;
}

#endif
