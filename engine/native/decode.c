/* One decode step of a Llama-shaped model (with the variations step.py admits: q/k/v biases, per-head or whole q/k
 * norms, GELU-tanh, Granite's multipliers, layers without RoPE, sliding windows, post-norms only, soft caps, local RoPE
 * tables, a rotary fraction, LayerNorms with or without biases, a plain MLP with biases and a GELU (tanh or erf),
 * attention output and head biases, a parallel residual block, interleaved RoPE, a mixture of experts whose router
 * picks the k experts whose matrices alone are read; CPU, batch 1; weights in float32, bfloat16 or float16, or
 * float32 with any matrix kept in its GGUF blocks) in one call: every layer, the final norm and the lm_head. In
 * bfloat16 or float16 it reads half the bytes of float32 and rounds each stage to the model's dtype where the
 * PyTorch forward in that dtype holds one (llama_ops.h), summing in float32.
 * Python (engine/native/step.py) compiles this file, checks each run's eligibility and falls back to the PyTorch
 * forward for anything else; engine/model.py stays the reference.
 *
 * Why: at batch 1 a decode step is bound by reading the weights (~545 MB for the bundled model), but eager
 * PyTorch spends ~1,100 small kernel launches around the 121 matrix products. Here the products stream each
 * matrix once, as the model stores it (rows split between threads, partial sums added), the small ops are plain loops on vectors
 * that sit in the L1 cache, and a step has one OpenMP parallel region with a barrier between phases.
 *
 * Statistics (optional, stats != NULL): min, max, mean, std (population, two-pass), absmax, nan, inf of every
 * stage the PyTorch forward offers at decode, in its order (embed, 17 per layer and each variation's own: q/k norms,
 * post-norms; final_norm, logits_uncapped with a final soft cap, logits), computed
 * while each stage is still in cache. A non-finite value anywhere makes the call return 1 (the caller redoes
 * the step with the PyTorch forward, whose NaN/Inf accounting is the reference); otherwise 0.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>

#include "llama_ops.h"
#include "quant_ops.h"
#include "row_product.h"
#include "rowstat.h"
#include "vexp.h"

typedef struct {
    int L, d, H, K, hd, F, V;      /* layers, hidden, query heads, KV heads, head dim, MLP width, vocab */
    int max_len, pos, nth;         /* KV cache length, this token's position, threads */
    int wtype, ctype;              /* the weights' (and activations') type, the KV cache's (llama_ops.h: T_F32 ..) */
    float eps, scale;              /* RMSNorm epsilon, attention scale (hd^-0.5) */
    const float *x_in;             /* (d) the token's embedding row, in float32 */
    const void *const *attn_norm, *const *wqkv, *const *wo;       /* L pointers each, of wtype; matrices (in, out) */
    const void *const *mlp_norm, *const *wgu, *const *wdown;
    void *kc, *vc;                 /* (L, K, max_len, hd) caches of ctype; this step writes position pos */
    const float *cos, *sin;        /* (hd) rotary rows of position pos, in float32 */
    const void *final_norm, *lm_head;    /* (d), (d, V), of wtype */
    float *logits;                 /* (V) out */
    float *work;                   /* scratch, llmi_work_floats() floats */
    float *stats;                  /* NULL, or (the step's stages: step.py's names) x 7 out */
    double *marks;                 /* NULL, or L + 2 out: seconds since the call began when the embedding, each
                                      layer and the logits were done (the PyTorch forward's timing marks) */
    const int *qwqkv, *qwo, *qwgu, *qwdown;   /* L GGML types each: 0, the slot's matrix is (in, out) of wtype; else
                                                 it is kept in GGUF blocks, (out, in) rows (engine/quant_matrix.py) */
    int qlm;                       /* the lm_head's: 0 or a GGML type ((V, d) rows: a tied model's token embedding) */
    /* the family's variations (step.py derives them from its declaration; NULL, 0 or 1: Llama's) */
    const void *const *bqkv;       /* NULL, or L (H + 2K) hd q/k/v biases of wtype (Qwen2) */
    const void *const *q_norm, *const *k_norm;   /* NULL, or L (hd) weights: each head's q, k RMS-normed (Qwen3) */
    const int *rope_on;            /* NULL (every layer rotates by the main table), or L: 0 = q and k unrotated
                                      (SmolLM3), 1 = by the main table, 2 = by the local one (Gemma 3) */
    int act;                       /* the gated MLP's activation: 0 SiLU, 1 GELU-tanh (Gemma) */
    float resid_scale, logits_div; /* each branch's output x resid_scale, the logits / logits_div (Granite) */
    const int *rows;               /* NULL (kc, vc: one block), or L: the rows of each layer's cache (KVCache.rows):
                                      a sliding-window layer's ring of `window` rows, position p in row p % rows
                                      (Mistral), else max_len */
    void *const *lkc, *const *lvc; /* with rows: L pointers to (K, rows[l], hd) caches of ctype */
    const void *const *attn_post_norm, *const *mlp_post_norm;   /* NULL, or L (d) weights: each branch's output
                                                                   RMS-normed before it joins the stream (Gemma 2) */
    float attn_cap, final_cap;     /* 0, or the soft caps tanh(s / cap) * cap of the scores, the logits (Gemma 2) */
    const float *cos_local, *sin_local;   /* rope_on[l] == 2: the local table's rows (Gemma 3's sliding layers) */
    int rd;                        /* the rotated dimensions of each head: hd, or fewer (Phi-3's rotary fraction) */
    const float *const *add;       /* NULL, or L pointers: NULL, or (d) values already rounded to wtype, added to the
                                      stream after block l (its resid_post: a probe's declared addition, Probe.add) */
    /* attn_norm or mlp_norm NULL: the block has no such pre-norm (OLMo 2: its branches read the stream itself) */
    int qk_whole;                  /* q_norm / k_norm are (H hd), (K hd): one RMSNorm over the projection (OLMo 2) */
    int layer_norm;                /* the pre-norms and the final norm are LayerNorms (engine/norms.py) */
    const void *const *attn_norm_b, *const *mlp_norm_b;   /* NULL, or L (d) LayerNorm biases of wtype */
    const void *final_norm_b;      /* NULL, or (d) */
    const void *const *bo;         /* NULL, or L (d) biases added to the attention's output product (GPT-2) */
    int plain;                     /* a plain MLP: wgu is (d, F) up, act(up + b_up) @ down + b_down (GPT-2) */
    const void *const *bup, *const *bdown;   /* NULL, or L (F), (d) biases of the MLP's products */
    int parallel;                  /* x + attn(norm1(x)) + mlp(norm2(x) or, no mlp_norm, norm1(x)) (GPT-NeoX, Phi) */
    int rope_pairs;                /* adjacent dimensions rotate together (Cohere), not the two halves */
    const void *head_bias;         /* NULL, or (V) of wtype added to the logits (Phi) */
    /* a mixture of experts (Mixtral, Qwen3-MoE: engine/moe.py): NULL, or L pointers, NULL at a dense layer (Qwen3-MoE's
     * mlp_only_layers, whose wgu / wdown are then given) */
    const void *const *router;     /* (d, E) of wtype */
    const void *const *egu, *const *edown;   /* (E, d, 2 Fe), (E, Fe, d) of wtype: only the chosen experts' read */
    int E, topk, Fe, renorm;       /* experts, chosen a token, each expert's MLP width, top-k gates renormalised */
    /* NULL, or L kernel codes of the experts' stacks (0 at a layer whose stack is float): a stack kept in GGUF blocks
     * (engine.quant_experts) holds expert e's N rows of K values in blocks at e N K / values x bytes (gate | up:
     * N = 2 Fe rows of d; down: N = d rows of Fe) */
    const int *qegu, *qedown;
} Step;

/* bytes of one expert's matrix in its stack: N rows of K values, float of wsz bytes or GGUF blocks of code q */
static size_t expert_bytes(int q, long N, long K, size_t wsz) {
    const int type = q & ~Q_INT8;
    return q ? (size_t)N * (size_t)(K / q_block_values(type) * q_block_bytes(type)) : (size_t)N * (size_t)K * wsz;
}

/* F: the widest MLP of a layer, max(F, Fe, E) with experts (step.py passes it; llmi_decode_step lays out the same) */
long llmi_work_floats(int d, int H, int K, int hd, int F, int V, int max_len, int nth) {
    long qkv = (long)(H + 2 * K) * hd, wide = V > 2 * F ? V : 2 * F;
    if (wide < qkv) wide = qkv;
    if (wide < d + 64L) wide = d + 64L;     /* a thread's x rounded to 8 bits (row_product.h's product, Q_INT8) */
    return 6L * d + qkv + (long)H * max_len + (long)H * hd + 5L * F + (long)nth * (wide + 16) + 64;
}

/* out[0:E] = h @ R (R: (d, E) of type t, E a few experts: a loop, not a streamed product), rounded to t */
static void router_logits(const float *h, const void *R, int d, int E, float *out, int t) {
    for (int e = 0; e < E; e++) out[e] = 0.f;
    for (int i = 0; i < d; i++)
        for (int e = 0; e < E; e++) out[e] += h[i] * ld(R, (size_t)i * E + e, t);
    round_to(out, E, t);
}

/* row_product_t, row_product and product: row_product.h (one order of additions for the lone step and the
 * batched rows' product_rows: batch invariance) */
/* out = x @ W + b (b: N values of type t, Qwen2's q/k/v biases), as the PyTorch forward's addmm: the bias joins the
 * float32 sum of the threads' partial sums before its one rounding to t (a bias added to product()'s rounded outputs
 * would round twice: in bfloat16 the logits of a tiny Qwen2 then lay ~2.7 ulps from the PyTorch forward's instead of
 * ~0.06). A matrix in GGUF blocks (float32 models): product(), then the bias added in float32. */
static void product_bias(const float *x, const void *W, const void *b, int K, int N, float *out, float *part,
                         long stride, int t, int q) {
    const int u0 = omp_get_thread_num(), T = omp_get_num_threads();
    const int n0 = (int)((long)N * u0 / T), n1 = (int)((long)N * (u0 + 1) / T);
    if (q) {
        product(x, W, K, N, out, part, stride, t, q);
        for (int n = n0; n < n1; n++) out[n] += ld(b, n, T_F32);
#pragma omp barrier
        return;
    }
    int k0, k1;
    row_share(K, u0, T, &k0, &k1);
    row_product(x, W, k0, k1, N, part + (size_t)u0 * stride, t);
#pragma omp barrier
    for (int n = n0; n < n1; n++) {
        float s = 0.f;
        for (int u = 0; u < T; u++) s += part[(size_t)u * stride + n];
        out[n] = s + ld(b, n, t);
    }
    round_to(out + n0, n1 - n0, t);
#pragma omp barrier
}

int llmi_decode_step(const Step *p) {
    const int d = p->d, H = p->H, K = p->K, hd = p->hd, F = p->F, V = p->V, S = p->pos + 1, G = H / K;
    const int Fe = p->Fe, Fw = F > Fe ? (F > p->E ? F : p->E) : (Fe > p->E ? Fe : p->E);  /* llmi_work_floats' F */
    const long qkv_n = (long)(H + 2 * K) * hd, wide0 = (V > 2 * Fw ? V : 2 * Fw) > qkv_n ? (V > 2 * Fw ? V : 2 * Fw)
                                                                                     : qkv_n;
    const long wide = wide0 > d + 64L ? wide0 : d + 64L;      /* llmi_work_floats' */
    const long stride = wide + 16;
    float *x = p->work, *h = x + d, *attn_out = h + d, *mlp_out = attn_out + d, *xf = mlp_out + d;
    float *qkv = xf + 2L * d, *scores = qkv + qkv_n, *z = scores + (long)H * p->max_len;
    float *gu = z + (long)H * hd, *act = gu + 2L * Fw, *rl = act + Fw, *gates = rl + Fw, *part = gates + Fw;
    float *y = xf;                   /* an expert's output (the final norm's buffer is free until the end) */
    int chosen[64];                  /* a token's experts, ascending */
    float *st = p->stats;
    int bad = 0;
    const long cache_layer = (long)K * p->max_len * hd;
    const int wt = p->wtype, ct = p->ctype;
    const size_t wsz = wt == T_F32 ? 4 : 2;      /* bytes of a weight element (an expert's matrix in the stack) */
    const size_t csz = ct == T_F32 ? 4 : 2;      /* bytes of a cache element */
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
            /* the layer's cache: R rows a head, this position's in row pos % R; it attends to the Sl positions its
             * window reaches (a ring: in row order, which the PyTorch forward reads in position order), and the
             * first = S - Sl before them are its pattern's zeros */
            const int R = p->rows ? p->rows[l] : p->max_len, Sl = S < R ? S : R;
            const long cache_head = (long)R * hd;
            char *kc = p->rows ? (char *)p->lkc[l] : (char *)p->kc + l * cache_layer * csz;
            char *vc = p->rows ? (char *)p->lvc[l] : (char *)p->vc + l * cache_layer * csz;
#pragma omp single
            {
                if (p->attn_norm) {
                    family_norm(x, p->attn_norm[l], p->attn_norm_b ? p->attn_norm_b[l] : NULL, p->layer_norm, d,
                                p->eps, h, wt);
                    if (st) bad |= stats7(h, d, st), st += NSTAT;
                } else {
                    for (int i = 0; i < d; i++) h[i] = x[i];
                }
            }
            if (p->bqkv) product_bias(h, p->wqkv[l], p->bqkv[l], d, (int)qkv_n, qkv, part, stride, wt, p->qwqkv[l]);
            else product(h, p->wqkv[l], d, (int)qkv_n, qkv, part, stride, wt, p->qwqkv[l]);
#pragma omp single
            {
                float *q = qkv, *k = qkv + (long)H * hd, *v = k + (long)K * hd;
                if (st) {   /* attn.q, attn.k, attn.v, [attn.q_norm, attn.k_norm], then attn.q_rot, attn.k_rot */
                    bad |= stats7(q, (long)H * hd, st);
                    bad |= stats7(k, (long)K * hd, st + NSTAT);
                    bad |= stats7(v, (long)K * hd, st + 2 * NSTAT);
                    st += 3 * NSTAT;
                }
                if (p->q_norm && p->qk_whole) {      /* OLMo 2: q's H heads as one vector, k's K */
                    rms_norm(q, p->q_norm[l], H * hd, p->eps, q, wt);
                    rms_norm(k, p->k_norm[l], K * hd, p->eps, k, wt);
                } else if (p->q_norm) {     /* in place: rms_norm reads a row whole before it writes */
                    for (int j = 0; j < H + K; j++)
                        rms_norm(qkv + (long)j * hd, j < H ? p->q_norm[l] : p->k_norm[l], hd, p->eps,
                                 qkv + (long)j * hd, wt);
                }
                if (p->q_norm && st) {
                    bad |= stats7(q, (long)H * hd, st);
                    bad |= stats7(k, (long)K * hd, st + NSTAT);
                    st += 2 * NSTAT;
                }
                if (!p->rope_on || p->rope_on[l] == 1)
                    rope_any(qkv, H + K, hd, p->rd, p->cos, p->sin, p->rope_pairs, wt);
                else if (p->rope_on[l] == 2)
                    rope_any(qkv, H + K, hd, p->rd, p->cos_local, p->sin_local, p->rope_pairs, wt);
                if (st) {
                    bad |= stats7(q, (long)H * hd, st);
                    bad |= stats7(k, (long)K * hd, st + NSTAT);
                    st += 2 * NSTAT;
                }
                const size_t at = (size_t)(p->pos % R) * hd * csz;
                cache_write(k, v, K, hd, kc + at, vc + at, cache_head, ct);
            }
#pragma omp for schedule(static)
            for (int hh = 0; hh < H; hh++) {   /* scores, softmax, weighted values: one query row a head */
                head_scores(qkv + (long)hh * hd, kc + (hh / G) * cache_head * csz, Sl, hd, p->scale,
                            scores + (long)hh * Sl, wt, ct);
                if (p->attn_cap != 0.f) softcap(scores + (long)hh * Sl, Sl, p->attn_cap, wt);
            }
#pragma omp single
            {
                if (st) bad |= stats7(scores, (long)H * Sl, st), st += NSTAT;   /* masked: the window's */
            }
#pragma omp for schedule(static)
            for (int hh = 0; hh < H; hh++) {
                head_softmax_values(scores + (long)hh * Sl, Sl, vc + (hh / G) * cache_head * csz, hd,
                                    z + (long)hh * hd, wt, ct);
            }
#pragma omp single
            {
                if (st) {
                    bad |= stats7(scores, (long)H * Sl, st);
                    if (Sl < S) zeros_joined(st, (long)H * Sl, (long)H * (S - Sl));
                    bad |= stats7(z, (long)H * hd, st + NSTAT);
                    st += 2 * NSTAT;
                }
            }
            product(z, p->wo[l], H * hd, d, attn_out, part, stride, wt, p->qwo[l]);
#pragma omp single
            {
                if (p->bo) add_vec(attn_out, p->bo[l], d, wt);      /* mm, then + bo: two roundings */
                if (p->resid_scale != 1.f) scale_to(attn_out, d, p->resid_scale, 1, wt);
                if (st) bad |= stats7(attn_out, d, st), st += NSTAT;
                if (p->attn_post_norm) {
                    rms_norm(attn_out, p->attn_post_norm[l], d, p->eps, attn_out, wt);
                    if (st) bad |= stats7(attn_out, d, st), st += NSTAT;
                }
                /* a parallel block's MLP reads the block's input (its own norm of it, or attn_norm's output still
                 * in h), and no stream lies between the halves (no resid_mid) */
                if (!p->parallel) {
                    add_to(x, attn_out, d, wt);
                    if (st) bad |= stats7(x, d, st), st += NSTAT;
                    if (!p->mlp_norm) for (int i = 0; i < d; i++) h[i] = x[i];
                }
                if (p->mlp_norm) {
                    family_norm(x, p->mlp_norm[l], p->mlp_norm_b ? p->mlp_norm_b[l] : NULL, p->layer_norm, d, p->eps,
                                h, wt);
                    if (st) bad |= stats7(h, d, st), st += NSTAT;
                }
            }
            if (p->router && p->router[l]) {       /* experts: the router, then the chosen experts' MLPs only */
#pragma omp single
                {
                    router_logits(h, p->router[l], d, p->E, rl, wt);
                    route_top_k(rl, p->E, p->topk, p->renorm, chosen, gates, wt);
                    if (st) {   /* mlp.router, mlp.experts (the routing row: 0 but at the chosen) */
                        bad |= stats7(rl, p->E, st);
                        bad |= stats7(gates, p->E, st + NSTAT);
                        st += 2 * NSTAT;
                    }
                    for (int i = 0; i < d; i++) mlp_out[i] = 0.f;
                }
                for (int j = 0; j < p->topk; j++) {
                    const int e = chosen[j];
                    if (gates[e] == 0.f) continue;     /* a gate rounded to 0: experts_mlp skips the expert */
                    const int qg = p->qegu ? p->qegu[l] : 0, qd = p->qedown ? p->qedown[l] : 0;
                    product(h, (const char *)p->egu[l] + (size_t)e * expert_bytes(qg, 2L * Fe, d, wsz), d, 2 * Fe,
                            gu, part, stride, wt, qg);
                    {
                        const int u = omp_get_thread_num(), T = omp_get_num_threads();
                        const long lo = (long)Fe * u / T, hi = (long)Fe * (u + 1) / T;
                        if (p->act) gelu_mul(gu, gu + Fe, act, lo, hi, wt);
                        else silu_mul(gu, gu + Fe, act, lo, hi, wt);
                    }
#pragma omp barrier
                    product(act, (const char *)p->edown[l] + (size_t)e * expert_bytes(qd, d, Fe, wsz), Fe, d, y, part,
                            stride, wt, qd);
#pragma omp single
                    {    /* out.index_add_(y * gate in t): each expert's share rounded, then the sum */
                        for (int i = 0; i < d; i++) mlp_out[i] = rnd(mlp_out[i] + rnd(y[i] * gates[e], wt), wt);
                    }
                }
            } else {
                const int up_n = p->plain ? F : 2 * F;      /* a gated MLP's product is gate | up */
                if (p->bup) product_bias(h, p->wgu[l], p->bup[l], d, up_n, gu, part, stride, wt, p->qwgu[l]);
                else product(h, p->wgu[l], d, up_n, gu, part, stride, wt, p->qwgu[l]);
                {    /* act(g) * up, or a plain MLP's act(up): the team's threads a share each */
                    const int u = omp_get_thread_num(), T = omp_get_num_threads();
                    const long lo = (long)F * u / T, hi = (long)F * (u + 1) / T;
                    if (p->plain) gelu_plain(gu, act, lo, hi, p->act, wt);
                    else if (p->act) gelu_mul(gu, gu + F, act, lo, hi, wt);
                    else silu_mul(gu, gu + F, act, lo, hi, wt);
                }
#pragma omp barrier
#pragma omp single
                {
                    if (st && p->plain) {   /* mlp.up, mlp.act */
                        bad |= stats7(gu, F, st);
                        bad |= stats7(act, F, st + NSTAT);
                        st += 2 * NSTAT;
                    } else if (st) {        /* mlp.gate, mlp.up, mlp.act */
                        bad |= stats7(gu, F, st);
                        bad |= stats7(gu + F, F, st + NSTAT);
                        bad |= stats7(act, F, st + 2 * NSTAT);
                        st += 3 * NSTAT;
                    }
                }
                if (p->bdown)
                    product_bias(act, p->wdown[l], p->bdown[l], F, d, mlp_out, part, stride, wt, p->qwdown[l]);
                else product(act, p->wdown[l], F, d, mlp_out, part, stride, wt, p->qwdown[l]);
            }
#pragma omp single
            {
                if (p->resid_scale != 1.f) scale_to(mlp_out, d, p->resid_scale, 1, wt);
                if (st) bad |= stats7(mlp_out, d, st), st += NSTAT;
                if (p->mlp_post_norm) {
                    rms_norm(mlp_out, p->mlp_post_norm[l], d, p->eps, mlp_out, wt);
                    if (st) bad |= stats7(mlp_out, d, st), st += NSTAT;
                }
                if (p->parallel) add_to(x, attn_out, d, wt);      /* (x + attn) + mlp_out, as the forward adds */
                add_to(x, mlp_out, d, wt);
                /* + the addition in wtype, as the PyTorch forward's x + v.to(x.dtype); resid_post's statistics are
                 * those after it (a replace hook's stage is recorded after the hook) */
                if (p->add && p->add[l]) add_to(x, p->add[l], d, wt);
                if (st) bad |= stats7(x, d, st), st += NSTAT;
                if (p->marks) p->marks[1 + l] = omp_get_wtime() - t0;
            }
        }
#pragma omp single
        {
            family_norm(x, p->final_norm, p->final_norm_b, p->layer_norm, d, p->eps, xf, wt);
            if (st) bad |= stats7(xf, d, st), st += NSTAT;
        }
        product(xf, p->lm_head, d, V, p->logits, part, stride, wt, p->qlm);
#pragma omp single
        {
            if (p->head_bias) add_vec(p->logits, p->head_bias, V, wt);
            if (p->logits_div != 1.f) scale_to(p->logits, V, p->logits_div, 0, wt);
            if (p->final_cap != 0.f) {      /* logits_uncapped, then the capped logits */
                if (st) bad |= stats7(p->logits, V, st), st += NSTAT;
                softcap(p->logits, V, p->final_cap, wt);
            }
            if (st) bad |= stats7(p->logits, V, st), st += NSTAT;
            if (p->marks) p->marks[p->L + 1] = omp_get_wtime() - t0;
        }
    }
    return bad;
}
