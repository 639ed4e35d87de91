/* The small per-row operations of a Llama block, shared by decode.c (one row) and decode_rows.c (a batch's rows). */
#ifndef LLMI_LLAMA_OPS_H
#define LLMI_LLAMA_OPS_H
#include <math.h>
#include <stddef.h>

#include "rowstat.h"
#include "vexp.h"

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

/* sc[0:S] = scale * (q . keys[s]) for one query head against S cached keys (rows of hd floats) */
static inline void head_scores(const float *q, const float *keys, int S, int hd, float scale, float *sc) {
    for (int s = 0; s < S; s++) {
        float dot = 0.f;
        const float *kk = keys + (long)s * hd;
#pragma omp simd reduction(+ : dot)
        for (int i = 0; i < hd; i++) dot += q[i] * kk[i];
        sc[s] = dot * scale;
    }
}

/* sc[0:S] softmaxed in place (the head's pattern), then zo[0:hd] = pattern @ vals (S rows of hd floats) */
static inline void head_softmax_values(float *sc, int S, const float *vals, int hd, float *zo) {
    float m = -INFINITY, sum = 0.f;
    for (int s = 0; s < S; s++) m = sc[s] > m ? sc[s] : m;
#pragma omp simd reduction(+ : sum)
    for (int s = 0; s < S; s++) sum += (sc[s] = exp_le0(sc[s] - m));
    const float inv = 1.f / sum;
    for (int i = 0; i < hd; i++) zo[i] = 0.f;
    for (int s = 0; s < S; s++) {
        const float w = (sc[s] *= inv);
        const float *vv = vals + (long)s * hd;
#pragma omp simd
        for (int i = 0; i < hd; i++) zo[i] += w * vv[i];
    }
}

#endif
