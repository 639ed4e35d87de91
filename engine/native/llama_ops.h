/* The small per-row operations of a Llama block, shared by decode.c (one row) and decode_rows.c (a batch's rows),
 * and the element types they read and write.
 *
 * Types: a model's weights and activations are float32, bfloat16 or float16 (wtype: T_F32, T_BF16, T_F16), its KV
 * cache likewise (ctype). The kernels keep every vector they work on in float32, holding values rounded to the
 * model's dtype wherever the PyTorch forward (engine/model.py, attention.py, rope.py) holds a tensor of that dtype
 * (`rnd`), and accumulate products and compute statistics in float32: the same numbers as the PyTorch forward in the
 * same dtype up to the order of its fp32 sums (a debugger never computes another model than it shows). A float16
 * value past 65504 becomes inf where the PyTorch forward's does. Each operation taking a type is written once as an
 * always_inline function of a constant type and called through a switch (BY_TYPE), so each type's loop is compiled
 * (and vectorised) on its own: bfloat16 -> float32 is a 16-bit shift, float16 -> float32 the F16C conversion. */
#ifndef LLMI_LLAMA_OPS_H
#define LLMI_LLAMA_OPS_H
#include <math.h>
#include <stddef.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "rowstat.h"
#include "vexp.h"

enum { T_F32 = 0, T_BF16 = 1, T_F16 = 2 };
#define LLMI_INLINE static inline __attribute__((always_inline))

/* f(t) compiled for each type, t a constant in each branch */
#define BY_TYPE(t, f) do { switch (t) { case T_BF16: f(T_BF16); break; case T_F16: f(T_F16); break; \
                                        default: f(T_F32); } } while (0)

/* element i of a vector of type t, as float32 (exact) */
LLMI_INLINE float ld(const void *p, size_t i, const int t) {
    if (t == T_BF16) {
        const unsigned u = (unsigned)((const unsigned short *)p)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    if (t == T_F16) {       /* in integer steps, so that a loop of them vectorises (GCC 12 keeps _Float16 scalar) */
        const unsigned h = ((const unsigned short *)p)[i], em = (h & 0x7fffu) << 13;
        float f;
        memcpy(&f, &em, sizeof f);
        f *= 0x1p112f;                  /* exponent 15 -> 127 biased; a subnormal half is exact too */
        unsigned u;
        memcpy(&u, &f, sizeof u);
        u = ((h & 0x7c00u) == 0x7c00u ? em | 0x7f800000u : u) | (h & 0x8000u) << 16;    /* inf and NaN kept */
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float *)p)[i];
}

typedef float v8 __attribute__((vector_size(32), aligned(4)));      /* eight floats, unaligned loads and stores */
typedef float v16 __attribute__((vector_size(64), aligned(4)));     /* sixteen: one AVX-512 register */
typedef unsigned short h8 __attribute__((vector_size(16), aligned(2)));      /* eight bfloat16 / float16 */
typedef unsigned short h16 __attribute__((vector_size(32), aligned(2)));
typedef unsigned u8 __attribute__((vector_size(32)));
typedef unsigned u16v __attribute__((vector_size(64)));

/* eight / sixteen elements of type t from element i of W, as float32 vectors (bfloat16: the bits shifted up;
 * float16: the F16C conversion, elementwise `ld` without it) */
LLMI_INLINE v8 load8(const void *W, size_t i, const int t) {
    if (t == T_BF16) return (v8)(__builtin_convertvector(*(const h8 *)((const unsigned short *)W + i), u8) << 16);
    if (t == T_F16) {
#if defined(__F16C__)
        return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const unsigned short *)W + i)));
#else
        v8 r;
        for (int j = 0; j < 8; j++) r[j] = ld(W, i + j, T_F16);
        return r;
#endif
    }
    return *(const v8 *)((const float *)W + i);
}
LLMI_INLINE v16 load16(const void *W, size_t i, const int t) {
    if (t == T_BF16) return (v16)(__builtin_convertvector(*(const h16 *)((const unsigned short *)W + i), u16v) << 16);
#if defined(__AVX512F__)
    if (t == T_F16) return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const unsigned short *)W + i)));
#endif
    const v8 a = load8(W, i, t), b = load8(W, i + 8, t);
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* x rounded to type t (to nearest, ties to even, as PyTorch converts; past the type's range: inf), as float32 */
LLMI_INLINE float rnd(float x, const int t) {
    if (t == T_BF16) {
        unsigned u;
        memcpy(&u, &x, sizeof u);
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        float r;
        memcpy(&r, &u, sizeof r);
        return x != x ? x : r;          /* a NaN stays a NaN (the carry would make some an inf) */
    }
    if (t == T_F16) return (float)(_Float16)x;
    return x;
}

/* element i of a vector of type t set to x, a value rounded to t (exact) */
LLMI_INLINE void put(void *p, size_t i, float x, const int t) {
    if (t == T_BF16) {
        unsigned u;
        memcpy(&u, &x, sizeof u);
        ((unsigned short *)p)[i] = (unsigned short)(u >> 16);
    } else if (t == T_F16) {
        ((_Float16 *)p)[i] = (_Float16)x;
    } else {
        ((float *)p)[i] = x;
    }
}

/* a[0:n] rounded to type t in place (a product's outputs: the PyTorch forward's matmul in t rounds each sum once) */
LLMI_INLINE void round_t(float *a, long n, const int t) {
    if (t == T_F32) return;
#pragma omp simd
    for (long i = 0; i < n; i++) a[i] = rnd(a[i], t);
}
static inline void round_to(float *a, long n, int t) {
#define F(T) round_t(a, n, T)
    BY_TYPE(t, F);
#undef F
}

/* min, max, mean, std, absmax, nan, inf of a[0:n] (rowstat.h); 1 when a value is not finite */
static inline int stats7(const float *a, long n, float *out) {
    return row_stat(a, 1, (int)n, 0, out);
}

/* h = x * rsqrt(mean(x^2) + eps) * w in float32, rounded once to t (F.rms_norm in bf16/fp16 rounds once too) */
LLMI_INLINE void rms_norm_t(const float *x, const void *w, int d, float eps, float *h, const int t) {
    float s = 0.f;
    for (int i = 0; i < d; i++) s += x[i] * x[i];
    const float r = 1.f / sqrtf(s / (float)d + eps);
    for (int i = 0; i < d; i++) h[i] = rnd((x[i] * r) * ld(w, i, t), t);
}
static inline void rms_norm(const float *x, const void *w, int d, float eps, float *h, int t) {
#define F(T) rms_norm_t(x, w, d, eps, h, T)
    BY_TYPE(t, F);
#undef F
}

/* x (heads, hd) with the first rd dimensions of each head rotated in place by half-split pairs (rd = hd: all; Phi-3's
 * partial_rotary_factor: fewer, the rest passed through): x*cos + rotate_half(x)*sin, each product and the sum
 * rounded to t as apply_rope's tensors are (cos, sin: the table's rd-wide rows, exact in float32) */
LLMI_INLINE void rope_part_t(float *x, int heads, int hd, int rd, const float *cos, const float *sin, const int t) {
    const int half = rd / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (size_t)h * hd;
        for (int i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = rnd(rnd(a * cos[i], t) - rnd(b * sin[i], t), t);
            v[i + half] = rnd(rnd(b * cos[i + half], t) + rnd(a * sin[i + half], t), t);
        }
    }
}
static inline void rope_part(float *x, int heads, int hd, int rd, const float *cos, const float *sin, int t) {
#define F(T) rope_part_t(x, heads, hd, rd, cos, sin, T)
    BY_TYPE(t, F);
#undef F
}
/* every dimension of each head rotated (Llama's) */
static inline void rope(float *x, int heads, int hd, const float *cos, const float *sin, int t) {
    rope_part(x, heads, hd, hd, cos, sin, t);
}

/* the k and v rows of KV head j .. (K heads of hd) written at kc / vc (cache rows of type ct, `head` elements apart) */
LLMI_INLINE void cache_write_t(const float *k, const float *v, int K, int hd, void *kc, void *vc, long head,
                               const int ct) {
    for (int j = 0; j < K; j++)
        for (int i = 0; i < hd; i++) {
            put(kc, (size_t)j * head + i, rnd(k[j * hd + i], ct), ct);
            put(vc, (size_t)j * head + i, rnd(v[j * hd + i], ct), ct);
        }
}
static inline void cache_write(const float *k, const float *v, int K, int hd, void *kc, void *vc, long head, int ct) {
#define F(T) cache_write_t(k, v, K, hd, kc, vc, head, T)
    BY_TYPE(ct, F);
#undef F
}

/* sc[0:S] = scale * (q . keys[s]) for one query head against S cached keys (rows of hd elements of type ct): the dot
 * in float32 rounded to t, then scaled and rounded again (the PyTorch forward's q @ k^T, then * scale) */
LLMI_INLINE void head_scores_t(const float *q, const void *keys, int S, int hd, float scale, float *sc, const int t,
                               const int ct) {
    for (int s = 0; s < S; s++) {
        float dot = 0.f;
        const size_t at = (size_t)s * hd;
#pragma omp simd reduction(+ : dot)
        for (int i = 0; i < hd; i++) dot += q[i] * ld(keys, at + i, ct);
        sc[s] = rnd(rnd(dot, t) * scale, t);
    }
}

/* sc[0:S] softmaxed in place in float32 and rounded to t (the head's pattern), then zo[0:hd] = pattern @ vals (S
 * rows of hd elements of type ct), summed in float32 and rounded to t */
LLMI_INLINE void head_softmax_values_t(float *sc, int S, const void *vals, int hd, float *zo, const int t,
                                       const int ct) {
    float m = -INFINITY, sum = 0.f;
    for (int s = 0; s < S; s++) m = sc[s] > m ? sc[s] : m;
#pragma omp simd reduction(+ : sum)
    for (int s = 0; s < S; s++) sum += (sc[s] = exp_le0(sc[s] - m));
    const float inv = 1.f / sum;
    for (int i = 0; i < hd; i++) zo[i] = 0.f;
    for (int s = 0; s < S; s++) {
        const float w = (sc[s] = rnd(sc[s] * inv, t));
        const size_t at = (size_t)s * hd;
#pragma omp simd
        for (int i = 0; i < hd; i++) zo[i] += w * ld(vals, at + i, ct);
    }
    round_t(zo, hd, t);
}

#define BY_TYPES(t, ct, f) do { switch ((t) * 3 + (ct)) { \
    case 0: f(T_F32, T_F32); break; case 1: f(T_F32, T_BF16); break; case 2: f(T_F32, T_F16); break; \
    case 3: f(T_BF16, T_F32); break; case 4: f(T_BF16, T_BF16); break; case 5: f(T_BF16, T_F16); break; \
    case 6: f(T_F16, T_F32); break; case 7: f(T_F16, T_BF16); break; default: f(T_F16, T_F16); } } while (0)

static inline void head_scores(const float *q, const void *keys, int S, int hd, float scale, float *sc, int t,
                               int ct) {
#define F(T, C) head_scores_t(q, keys, S, hd, scale, sc, T, C)
    BY_TYPES(t, ct, F);
#undef F
}
static inline void head_softmax_values(float *sc, int S, const void *vals, int hd, float *zo, int t, int ct) {
#define F(T, C) head_softmax_values_t(sc, S, vals, hd, zo, T, C)
    BY_TYPES(t, ct, F);
#undef F
}

/* act[0:F] = silu(g) * up, silu in float32 with e^-|g| (nothing overflows), rounded to t, then the product rounded
 * to t (the PyTorch forward's act_fn(gate) * up in t) */
LLMI_INLINE void silu_mul_t(const float *g, const float *up, float *act, long lo, long hi, const int t) {
#pragma omp simd
    for (long i = lo; i < hi; i++) {
        const float x = g[i], e = exp_le0(x < 0.f ? x : -x);
        act[i] = rnd(rnd((x < 0.f ? x * e : x) / (1.f + e), t) * up[i], t);
    }
}
static inline void silu_mul(const float *g, const float *up, float *act, long lo, long hi, int t) {
#define F(T) silu_mul_t(g, up, act, lo, hi, T)
    BY_TYPE(t, F);
#undef F
}

/* x[0:d] += y[0:d], each sum rounded to t (the residual stream's add in t) */
LLMI_INLINE void add_t(float *x, const float *y, int d, const int t) {
#pragma omp simd
    for (int i = 0; i < d; i++) x[i] = rnd(x[i] + y[i], t);
}
static inline void add_to(float *x, const float *y, int d, int t) {
#define F(T) add_t(x, y, d, T)
    BY_TYPE(t, F);
#undef F
}

/* The family variations of the lone decode step (decode.c; engine/native/step.py admits them from the family's
 * declaration): each the PyTorch forward's operation in t, rounded where it holds a tensor of t. */

/* x[0:n] * s (mul: Granite's residual_multiplier) or x[0:n] / s (Granite's logits_scaling), in float32 rounded to t
 * (a tensor of t times a Python number) */
LLMI_INLINE void scale_t(float *x, long n, float s, int mul, const int t) {
    if (mul) {
#pragma omp simd
        for (long i = 0; i < n; i++) x[i] = rnd(x[i] * s, t);
    } else {
#pragma omp simd
        for (long i = 0; i < n; i++) x[i] = rnd(x[i] / s, t);
    }
}
static inline void scale_to(float *x, long n, float s, int mul, int t) {
#define F(T) scale_t(x, n, s, mul, T)
    BY_TYPE(t, F);
#undef F
}

/* act[lo:hi] = gelu_tanh(g) * up (Gemma's F.gelu(approximate="tanh"), in float32 as PyTorch's kernel writes it:
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), rounded to t, then the product rounded to t) */
LLMI_INLINE void gelu_mul_t(const float *g, const float *up, float *act, long lo, long hi, const int t) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    for (long i = lo; i < hi; i++) {
        const float x = g[i], inner = beta * (x + kappa * (x * x * x));
        act[i] = rnd(rnd(0.5f * x * (1.f + tanhf(inner)), t) * up[i], t);
    }
}
static inline void gelu_mul(const float *g, const float *up, float *act, long lo, long hi, int t) {
#define F(T) gelu_mul_t(g, up, act, lo, hi, T)
    BY_TYPE(t, F);
#undef F
}

/* x[0:n] = tanh(x / cap) * cap (Gemma 2's soft caps of the scores and the logits), each of the three tensors the
 * PyTorch forward makes rounded to t */
LLMI_INLINE void softcap_t(float *x, long n, float cap, const int t) {
    for (long i = 0; i < n; i++) x[i] = rnd(rnd(tanhf(rnd(x[i] / cap, t)), t) * cap, t);
}
static inline void softcap(float *x, long n, float cap, int t) {
#define F(T) softcap_t(x, n, cap, T)
    BY_TYPE(t, F);
#undef F
}

/* o: the seven statistics (rowstat.h) of n values, made those of the n values and pad zeros beside them (a window
 * layer's pattern, which the PyTorch forward offers over every position, 0 before the window): the mean and the sum
 * of squared deviations moved to the joined set in double, min and max taking in 0 */
static inline void zeros_joined(float *o, long n, long pad) {
    const double N = (double)(n + pad), m = o[2], m2 = m * (double)n / N;
    const double q = (double)o[3] * o[3] * (double)n + (double)n * (m - m2) * (m - m2) + (double)pad * m2 * m2;
    o[0] = o[0] < 0.f ? o[0] : 0.f, o[1] = o[1] > 0.f ? o[1] : 0.f;
    o[2] = (float)m2, o[3] = (float)sqrt(q / N), o[4] = fabsf(o[0]) > fabsf(o[1]) ? fabsf(o[0]) : fabsf(o[1]);
}

/* The LayerNorm, plain-MLP, bias and interleaved-RoPE variations (GPT-2, GPT-NeoX, Phi, StableLM, StarCoder 2,
 * Cohere; engine/norms.py, engine/model.py, engine/rope.py), each the PyTorch forward's operation in t. */

/* h = (x rstd - mean rstd) w (+ b), rstd = rsqrt(var + eps), in float32 (mean and population variance in two
 * passes), rounded once to t: F.layer_norm's CPU kernel in that order, in bfloat16 / float16 computing in float32
 * and rounding its output once. b: NULL (Cohere's bias-free LayerNorm) or d values of t */
LLMI_INLINE void layer_norm_t(const float *x, const void *w, const void *b, int d, float eps, float *h, const int t) {
    float s = 0.f, q = 0.f;
    for (int i = 0; i < d; i++) s += x[i];
    const float mean = s / (float)d;
    for (int i = 0; i < d; i++) q += (x[i] - mean) * (x[i] - mean);
    const float r = 1.f / sqrtf(q / (float)d + eps), shift = -mean * r;
    for (int i = 0; i < d; i++) h[i] = rnd((x[i] * r + shift) * ld(w, i, t) + (b ? ld(b, i, t) : 0.f), t);
}
/* the family's norm of x into h: LayerNorm (layer != 0, with bias b or none) or RMSNorm (b unused) */
static inline void family_norm(const float *x, const void *w, const void *b, int layer, int d, float eps, float *h,
                               int t) {
#define F(T) layer_norm_t(x, w, b, d, eps, h, T)
    if (layer) BY_TYPE(t, F);
    else rms_norm(x, w, d, eps, h, t);
#undef F
}

/* x[0:n] += b[0:n] (b: n values of t), each sum rounded to t: a bias added to a product already rounded (the
 * PyTorch forward's `out + bo`, Phi's `logits + head_bias`: two tensors of t) */
LLMI_INLINE void add_vec_t(float *x, const void *b, long n, const int t) {
    for (long i = 0; i < n; i++) x[i] = rnd(x[i] + ld(b, i, t), t);
}
static inline void add_vec(float *x, const void *b, long n, int t) {
#define F(T) add_vec_t(x, b, n, T)
    BY_TYPE(t, F);
#undef F
}

/* act[lo:hi] = gelu(up) of a plain MLP (no gate), in float32 rounded once to t: kind 1 GELU-tanh (GPT-2, Phi,
 * StarCoder 2: gelu_mul's formula), kind 2 the exact erf GELU 0.5 x (1 + erf(x / sqrt 2)) (GPT-NeoX's F.gelu) */
LLMI_INLINE void gelu_plain_t(const float *up, float *act, long lo, long hi, int kind, const int t) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    if (kind == 2) {
        for (long i = lo; i < hi; i++) act[i] = rnd(0.5f * up[i] * (1.f + erff(up[i] * 0.70710678118654752f)), t);
        return;
    }
    for (long i = lo; i < hi; i++) {
        const float x = up[i], inner = beta * (x + kappa * (x * x * x));
        act[i] = rnd(0.5f * x * (1.f + tanhf(inner)), t);
    }
}
static inline void gelu_plain(const float *up, float *act, long lo, long hi, int kind, int t) {
#define F(T) gelu_plain_t(up, act, lo, hi, kind, T)
    BY_TYPE(t, F);
#undef F
}

/* x (heads, hd) with the first rd dimensions of each head rotated in place by adjacent pairs (Cohere's interleaved
 * RoPE: (x0, x1) -> (x0 c0 - x1 s0, x1 c1 + x0 s1), the table's frequencies repeated in pairs), each product and
 * the sum rounded to t as apply_rope(pairs=True)'s tensors are */
LLMI_INLINE void rope_pairs_t(float *x, int heads, int hd, int rd, const float *cos, const float *sin, const int t) {
    for (int h = 0; h < heads; h++) {
        float *v = x + (size_t)h * hd;
        for (int i = 0; i < rd; i += 2) {
            const float a = v[i], b = v[i + 1];
            v[i] = rnd(rnd(a * cos[i], t) - rnd(b * sin[i], t), t);
            v[i + 1] = rnd(rnd(b * cos[i + 1], t) + rnd(a * sin[i + 1], t), t);
        }
    }
}
/* the half-split rotation (rope_part) or, pairs != 0, the interleaved one */
static inline void rope_any(float *x, int heads, int hd, int rd, const float *cos, const float *sin, int pairs,
                            int t) {
#define F(T) rope_pairs_t(x, heads, hd, rd, cos, sin, T)
    if (pairs) BY_TYPE(t, F);
    else rope_part(x, heads, hd, rd, cos, sin, t);
#undef F
}

/* A mixture of experts' router (Mixtral, Qwen3-MoE; engine/moe.py's route): logits[0:E] (already rounded to t, the
 * router's product) -> the k chosen experts in ascending order (the order experts_mlp adds them) and their gates:
 * softmax in float32, the top k (the larger first; of equals, the lower index), optionally renormalised over the top
 * k, each gate then rounded to t (route's .to(dtype)); gates[0:E] the routing row, 0 but at the chosen. k <= 64
 * (step.py refuses more) */
static inline void route_top_k(const float *logits, int E, int k, int renorm, int *chosen, float *gates, int t) {
    float m = -INFINITY, sum = 0.f, top[64], kept = 0.f;
    int at[64];
    for (int e = 0; e < E; e++) m = logits[e] > m ? logits[e] : m;
    for (int e = 0; e < E; e++) sum += (gates[e] = exp_le0(logits[e] - m));
    for (int e = 0; e < E; e++) gates[e] /= sum;
    for (int j = 0; j < k; j++) {         /* selection: k is small */
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= at[i] == e;
            if (!taken && (best < 0 || gates[e] > gates[best])) best = e;
        }
        at[j] = best, top[j] = gates[best];
    }
    for (int j = 0; j < k; j++) kept += top[j];
    for (int e = 0; e < E; e++) gates[e] = 0.f;
    for (int j = 0; j < k; j++) gates[at[j]] = rnd(renorm ? top[j] / kept : top[j], t);
    for (int e = 0, n = 0; e < E && n < k; e++)
        for (int j = 0; j < k; j++)
            if (at[j] == e) chosen[n++] = e;
}

#endif
