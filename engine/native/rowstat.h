/* The seven statistics of one row, shared by decode.c (each stage of a decode step) and inspect.c. */
#ifndef LLMI_ROWSTAT_H
#define LLMI_ROWSTAT_H
#include <math.h>

enum { NSTAT = 7 };

/* The seven statistics (min, max, mean, std (population, two-pass), absmax, nan, inf) of row t of a tensor
 * whose element (t, g, i) is at x[t * st + g * sg + i], read while the row is in cache. Returns 1 if the row
 * holds a NaN or Inf (the caller then takes the PyTorch path, whose accounting of them is the reference). */
static inline int row_stat(const float *x, int G, int n, long sg, float *o) {
    double s = 0.0;
    float lo = INFINITY, hi = -INFINITY;
    for (int g = 0; g < G; g++) {
        const float *r = x + (long)g * sg;
        float s1 = 0.f;
#pragma omp simd reduction(+ : s1) reduction(min : lo) reduction(max : hi)
        for (int i = 0; i < n; i++) {
            const float v = r[i];
            s1 += v;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        s += s1;
    }
    if (!isfinite(s)) return 1;
    const float m = (float)(s / ((double)G * n));
    double q = 0.0;
    for (int g = 0; g < G; g++) {
        const float *r = x + (long)g * sg;
        float q1 = 0.f;
#pragma omp simd reduction(+ : q1)
        for (int i = 0; i < n; i++) {
            const float e = r[i] - m;
            q1 += e * e;
        }
        q += q1;
    }
    o[0] = lo, o[1] = hi, o[2] = m, o[3] = (float)sqrt(q / ((double)G * n));
    o[4] = fabsf(lo) > fabsf(hi) ? fabsf(lo) : fabsf(hi), o[5] = o[6] = 0.f;
    return 0;
}

#endif
