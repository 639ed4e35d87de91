/* One decode step of a Llama-family model (fp32, CPU, batch 1) in one call: every layer, the final norm and
 * the lm_head. Python (engine/native/step.py) compiles this file, checks each run's eligibility and falls
 * back to the PyTorch forward for anything else; engine/model.py stays the reference.
 *
 * Why: at batch 1 a decode step is bound by reading the weights (~545 MB for the bundled model), but eager
 * PyTorch spends ~1,100 small kernel launches around the 121 matrix products. Here the products stream each
 * matrix once, as the model stores it (rows split between threads, partial sums added), the small ops are plain loops on vectors
 * that sit in the L1 cache, and a step has one OpenMP parallel region with a barrier between phases.
 *
 * Statistics (optional, stats != NULL): min, max, mean, std (population, two-pass), absmax, nan, inf of every
 * stage the PyTorch forward offers at decode, in its order (embed, 17 per layer, final_norm, logits), computed
 * while each stage is still in cache. A non-finite value anywhere makes the call return 1 (the caller redoes
 * the step with the PyTorch forward, whose NaN/Inf accounting is the reference); otherwise 0.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>

#include "llama_ops.h"
#include "rowstat.h"
#include "vexp.h"

typedef struct {
    int L, d, H, K, hd, F, V;      /* layers, hidden, query heads, KV heads, head dim, MLP width, vocab */
    int max_len, pos, nth;         /* KV cache length, this token's position, threads */
    float eps, scale;              /* RMSNorm epsilon, attention scale (hd^-0.5) */
    const float *x_in;             /* (d) the token's embedding row */
    const float *const *attn_norm, *const *wqkv, *const *wo;      /* L pointers each; matrices (in, out) */
    const float *const *mlp_norm, *const *wgu, *const *wdown;
    float *kc, *vc;                /* (L, K, max_len, hd) caches; this step writes position pos */
    const float *cos, *sin;        /* (hd) rotary rows of position pos */
    const float *final_norm, *lm_head;   /* (d), (d, V) */
    float *logits;                 /* (V) out */
    float *work;                   /* scratch, llmi_work_floats() floats */
    float *stats;                  /* NULL, or (1 + 17 L + 2) x 7 out */
    double *marks;                 /* NULL, or L + 2 out: seconds since the call began when the embedding, each
                                      layer and the logits were done (the PyTorch forward's timing marks) */
} Step;

long llmi_work_floats(int d, int H, int K, int hd, int F, int V, int max_len, int nth) {
    long qkv = (long)(H + 2 * K) * hd, wide = V > 2 * F ? V : 2 * F;
    if (wide < qkv) wide = qkv;
    return 6L * d + qkv + (long)H * max_len + (long)H * hd + 3L * F + (long)nth * (wide + 16) + 64;
}

/* acc[0:N] = x[k0:k1] @ W[k0:k1, :], W (K, N) row-major, as the model stores it (engine/weights.py: (in, out)): the
 * rows k0 .. k1 are one contiguous run of memory, taken four rows at a time (four streams a thread, which the hardware
 * prefetcher follows; the sums of the four rows are added before they reach acc, so acc, which stays in the L1 or L2
 * cache, is read and written once every four rows). The native step reads the model's own matrices: no second copy.
 * (Earlier the step read a copy laid out as panels of eight rows, the matrices' size again in memory; on the
 * bundled model's products the two ran within a few per cent of each other here.) */
static void row_product(const float *x, const float *W, int k0, int k1, int N, float *acc) {
    for (int n = 0; n < N; n++) acc[n] = 0.f;
    int k = k0;
    for (; k + 4 <= k1; k += 4) {
        const float a0 = x[k], a1 = x[k + 1], a2 = x[k + 2], a3 = x[k + 3];
        const float *w0 = W + (size_t)k * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
#pragma omp simd
        for (int n = 0; n < N; n++) acc[n] += (a0 * w0[n] + a1 * w1[n]) + (a2 * w2[n] + a3 * w3[n]);
    }
    for (; k < k1; k++) {
        const float a = x[k], *w = W + (size_t)k * N;
#pragma omp simd
        for (int n = 0; n < N; n++) acc[n] += a * w[n];
    }
}

/* out = x @ W, called by every thread of the team: each reads its share of W's rows (blocks of eight) once. */
static void product(const float *x, const float *W, int K, int N, float *out, float *part, long stride) {
    int t = omp_get_thread_num(), T = omp_get_num_threads(), G = K / 8;
    int g0 = (int)((long)G * t / T), g1 = (int)((long)G * (t + 1) / T);
    row_product(x, W, 8 * g0, 8 * g1, N, part + (size_t)t * stride);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        float s = 0.f;
        for (int u = 0; u < T; u++) s += part[(size_t)u * stride + n];
        out[n] = s;
    }
}

int llmi_decode_step(const Step *p) {
    const int d = p->d, H = p->H, K = p->K, hd = p->hd, F = p->F, V = p->V, S = p->pos + 1, G = H / K;
    const long qkv_n = (long)(H + 2 * K) * hd, wide = (V > 2 * F ? V : 2 * F) > qkv_n ? (V > 2 * F ? V : 2 * F) : qkv_n;
    const long stride = wide + 16;
    float *x = p->work, *h = x + d, *attn_out = h + d, *mlp_out = attn_out + d, *xf = mlp_out + d;
    float *qkv = xf + 2L * d, *scores = qkv + qkv_n, *z = scores + (long)H * p->max_len;
    float *gu = z + (long)H * hd, *act = gu + 2L * F, *part = act + F;
    float *st = p->stats;
    int bad = 0;
    const long cache_layer = (long)K * p->max_len * hd, cache_head = (long)p->max_len * hd;
    const double t0 = omp_get_wtime();

#pragma omp parallel num_threads(p->nth)
    {
#pragma omp single
        {
            for (int i = 0; i < d; i++) x[i] = p->x_in[i];
            if (st) bad |= stats7(x, d, st), st += NSTAT;
            if (p->marks) p->marks[0] = omp_get_wtime() - t0;
        }
        for (int l = 0; l < p->L; l++) {
            float *kc = p->kc + l * cache_layer, *vc = p->vc + l * cache_layer;
#pragma omp single
            {
                rms_norm(x, p->attn_norm[l], d, p->eps, h);
                if (st) bad |= stats7(h, d, st), st += NSTAT;
            }
            product(h, p->wqkv[l], d, (int)qkv_n, qkv, part, stride);
#pragma omp single
            {
                float *q = qkv, *k = qkv + (long)H * hd, *v = k + (long)K * hd;
                if (st) {   /* attn.q, attn.k, attn.v, then attn.q_rot, attn.k_rot */
                    bad |= stats7(q, (long)H * hd, st);
                    bad |= stats7(k, (long)K * hd, st + NSTAT);
                    bad |= stats7(v, (long)K * hd, st + 2 * NSTAT);
                }
                rope(qkv, H + K, hd, p->cos, p->sin);
                if (st) {
                    bad |= stats7(q, (long)H * hd, st + 3 * NSTAT);
                    bad |= stats7(k, (long)K * hd, st + 4 * NSTAT);
                    st += 5 * NSTAT;
                }
                for (int j = 0; j < K; j++)
                    for (int i = 0; i < hd; i++) {
                        kc[j * cache_head + (long)p->pos * hd + i] = k[j * hd + i];
                        vc[j * cache_head + (long)p->pos * hd + i] = v[j * hd + i];
                    }
            }
#pragma omp for schedule(static)
            for (int hh = 0; hh < H; hh++) {   /* scores, softmax, weighted values: one query row a head */
                head_scores(qkv + (long)hh * hd, kc + (hh / G) * cache_head, S, hd, p->scale, scores + (long)hh * S);
            }
#pragma omp single
            {
                if (st) bad |= stats7(scores, (long)H * S, st), st += NSTAT;
            }
#pragma omp for schedule(static)
            for (int hh = 0; hh < H; hh++) {
                head_softmax_values(scores + (long)hh * S, S, vc + (hh / G) * cache_head, hd, z + (long)hh * hd);
            }
#pragma omp single
            {
                if (st) {
                    bad |= stats7(scores, (long)H * S, st);
                    bad |= stats7(z, (long)H * hd, st + NSTAT);
                    st += 2 * NSTAT;
                }
            }
            product(z, p->wo[l], H * hd, d, attn_out, part, stride);
#pragma omp single
            {
                for (int i = 0; i < d; i++) x[i] += attn_out[i];
                rms_norm(x, p->mlp_norm[l], d, p->eps, h);
                if (st) {
                    bad |= stats7(attn_out, d, st);
                    bad |= stats7(x, d, st + NSTAT);
                    bad |= stats7(h, d, st + 2 * NSTAT);
                    st += 3 * NSTAT;
                }
            }
            product(h, p->wgu[l], d, 2 * F, gu, part, stride);
#pragma omp for simd schedule(static)
            for (int i = 0; i < F; i++) {    /* silu(g) * up, e^-|g| so that nothing overflows */
                const float g = gu[i], e = exp_le0(g < 0.f ? g : -g);
                act[i] = (g < 0.f ? g * e : g) / (1.f + e) * gu[F + i];
            }
#pragma omp single
            {
                if (st) {
                    bad |= stats7(gu, F, st);
                    bad |= stats7(gu + F, F, st + NSTAT);
                    bad |= stats7(act, F, st + 2 * NSTAT);
                    st += 3 * NSTAT;
                }
            }
            product(act, p->wdown[l], F, d, mlp_out, part, stride);
#pragma omp single
            {
                for (int i = 0; i < d; i++) x[i] += mlp_out[i];
                if (st) {
                    bad |= stats7(mlp_out, d, st);
                    bad |= stats7(x, d, st + NSTAT);
                    st += 2 * NSTAT;
                }
                if (p->marks) p->marks[1 + l] = omp_get_wtime() - t0;
            }
        }
#pragma omp single
        {
            rms_norm(x, p->final_norm, d, p->eps, xf);
            if (st) bad |= stats7(xf, d, st), st += NSTAT;
        }
        product(xf, p->lm_head, d, V, p->logits, part, stride);
#pragma omp single
        {
            if (st) bad |= stats7(p->logits, V, st), st += NSTAT;
            if (p->marks) p->marks[p->L + 1] = omp_get_wtime() - t0;
        }
    }
    return bad;
}
