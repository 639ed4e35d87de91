/* The small per-row operations of a Llama block, shared by decode.c (one row) and decode_rows.c (a batch's rows). */
#ifndef LLMI_LLAMA_OPS_H
#define LLMI_LLAMA_OPS_H
#include <math.h>
#include <stddef.h>

#include "rowstat.h"

/* min, max, mean, std, absmax, nan, inf of a[0:n] (rowstat.h); 1 when a value is not finite */
static inline int stats7(const float *a, long n, float *out) {
    return row_stat(a, 1, (int)n, 0, out);
}

static inline void rms_norm(const float *x, const float *w, int d, float eps, float *h) {
    float s = 0.f;
    for (int i = 0; i < d; i++) s += x[i] * x[i];
    const float r = 1.f / sqrtf(s / (float)d + eps);
    for (int i = 0; i < d; i++) h[i] = (x[i] * r) * w[i];
}

/* x (heads, hd) rotated in place by half-split pairs: x*cos + rotate_half(x)*sin */
static inline void rope(float *x, int heads, int hd, const float *cos, const float *sin) {
    const int half = hd / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (size_t)h * hd;
        for (int i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

#endif
