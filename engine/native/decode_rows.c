/* One decode step of several runs at once (CPU; weights in float32, bfloat16 or float16, as decode.c): B rows,
 * each one token of its own run, at its own position against its own KV cache, through every layer, the final norm
 * and the lm_head, in one call. The batched counterpart of decode.c's llmi_decode_step (engine/batch: the runs in
 * flight that decode together); engine/native/step.py calls it, and the PyTorch batched forward
 * (Model.forward_batch over Batch.rows) stays the reference.
 *
 * Why: a batched step on the PyTorch path spent most of its time around the matrix products, in a few torch calls
 * per row per layer (each row's cache write, its padded keys, its statistics), ~4.5 ms a row a step for the
 * bundled model. Here the products read each weight once from memory for all rows (row_product.h: each thread its
 * share of W's rows, a span of columns at a time), and every per-row operation is a plain loop, rows spread over
 * the team.
 *
 * Batch invariance: every row is computed exactly as llmi_decode_step computes its token alone, bit for bit, with
 * the same team of threads: the products sum each output in decode.c's order (row_product.h), and every other
 * operation is the same function of llama_ops.h / rowstat.h on the row's own vectors (silu in decode.c's shares).
 * So a run's logits and statistics do not depend on which runs, or how many, share its step.
 *
 * Additions (optional): row b's own vector added to its stream after block l (a steering vector: its run's probe,
 * Probe.add); a row without one is computed as it is alone, whatever its neighbours add.
 *
 * Statistics (optional): per row, the same stages in the same order as llmi_decode_step (embed, 17 per layer,
 * final_norm, logits), the same kernel (rowstat.h). bad[b] is set when row b meets a NaN or Inf; the call returns
 * how many rows did (the caller then redoes the step on the PyTorch path, which rewrites the same cache positions).
 */
#include <omp.h>
#include <stddef.h>

#include "llama_ops.h"
#include "row_product.h"
#include "rowstat.h"
#include "vexp.h"

typedef struct {
    int L, d, H, K, hd, F, V, B, nth;  /* layers, hidden, query heads, KV heads, head dim, MLP width, vocab, rows */
    int wtype, ctype;                   /* the weights' (and activations') type, the KV caches' (llama_ops.h) */
    float eps, scale;                   /* RMSNorm epsilon, attention scale (hd^-0.5) */
    const float *x_in;                  /* (B, d) the rows' embeddings, in float32 */
    const void *const *attn_norm, *const *wqkv, *const *wo;       /* L pointers each, of wtype; matrices (in, out) */
    const void *const *mlp_norm, *const *wgu, *const *wdown;
    void *const *kc, *const *vc;        /* B pointers: row b's caches of ctype, (L, K, max_len[b], hd) each */
    const int *max_len, *pos;           /* (B) each row's cache length and this token's position */
    const float *cos, *sin;             /* (B, hd) rotary rows at each row's position, in float32 */
    const void *final_norm, *lm_head;   /* (d), (d, V), of wtype */
    float *logits;                      /* (B, V) out */
    float *work;                        /* scratch, llmi_rows_work_floats() floats */
    float *stats;                       /* NULL, or (B, 1 + 17 L + 2, 7) out */
    double *marks;                      /* NULL, or L + 2 out (as llmi_decode_step's) */
    int *bad;                           /* (B) out: 1 where the row met a NaN or Inf (with statistics) */
    const float *const *add;            /* NULL, or B x L pointers (row b's layer l at b * L + l): NULL, or (d) values
                                           already rounded to wtype, added to row b's stream after block l (its
                                           resid_post: a probe's declared addition, engine.inspection.probe) */
} Rows;

enum { PER_LAYER = 17 };               /* statistics rows a layer */

long llmi_rows_work_floats(int B, int d, int H, int K, int hd, int F, int V, int longest, int nth) {
    long qkv = (long)(H + 2 * K) * hd, wide = V > 2 * F ? V : 2 * F;
    if (wide < qkv) wide = qkv;
    return (long)B * (5L * d + qkv + (long)H * longest + (long)H * hd + 3L * F) + (long)nth * B * wide + 64;
}

int llmi_decode_rows(const Rows *p) {
    const int d = p->d, H = p->H, K = p->K, hd = p->hd, F = p->F, V = p->V, B = p->B, G = H / K;
    const int NS = 1 + PER_LAYER * p->L + 2;
    const long qkv_n = (long)(H + 2 * K) * hd;
    int longest = 1;
    for (int b = 0; b < B; b++) longest = p->pos[b] + 1 > longest ? p->pos[b] + 1 : longest;
    float *x = p->work, *h = x + (long)B * d, *attn_out = h + (long)B * d, *mlp_out = attn_out + (long)B * d;
    float *xf = mlp_out + (long)B * d, *qkv = xf + (long)B * d, *scores = qkv + B * qkv_n;
    float *z = scores + (long)B * H * longest, *gu = z + (long)B * H * hd, *act = gu + 2L * B * F;
    float *part = act + (long)B * F;             /* (nth, B, widest N): the products' per-thread partial sums */
    const int wt = p->wtype, ct = p->ctype;
    const size_t csz = ct == T_F32 ? 4 : 2;      /* bytes of a cache element */
    const double t0 = omp_get_wtime();
#define ST(b, s) (p->stats + ((size_t)(b) * NS + (s)) * NSTAT)
#define BAD(b, e) (p->bad[b] |= (e))

    for (int b = 0; b < B; b++) p->bad[b] = 0;
#pragma omp parallel num_threads(p->nth)
    {
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            for (int i = 0; i < d; i++) x[(long)b * d + i] = p->x_in[(long)b * d + i];
            if (p->stats) BAD(b, stats7(x + (long)b * d, d, ST(b, 0)));
        }
#pragma omp single
        if (p->marks) p->marks[0] = omp_get_wtime() - t0;
        for (int l = 0; l < p->L; l++) {
            const int s0 = 1 + PER_LAYER * l;
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                rms_norm(x + (long)b * d, p->attn_norm[l], d, p->eps, h + (long)b * d, wt);
                if (p->stats) BAD(b, stats7(h + (long)b * d, d, ST(b, s0)));
            }
            product_rows(h, B, p->wqkv[l], d, (int)qkv_n, qkv, part, wt);
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                float *q = qkv + b * qkv_n, *k = q + (long)H * hd, *v = k + (long)K * hd;
                if (p->stats) {   /* attn.q, attn.k, attn.v, then attn.q_rot, attn.k_rot */
                    BAD(b, stats7(q, (long)H * hd, ST(b, s0 + 1)));
                    BAD(b, stats7(k, (long)K * hd, ST(b, s0 + 2)));
                    BAD(b, stats7(v, (long)K * hd, ST(b, s0 + 3)));
                }
                rope(q, H + K, hd, p->cos + (long)b * hd, p->sin + (long)b * hd, wt);
                if (p->stats) {
                    BAD(b, stats7(q, (long)H * hd, ST(b, s0 + 4)));
                    BAD(b, stats7(k, (long)K * hd, ST(b, s0 + 5)));
                }
                const size_t head = (size_t)p->max_len[b] * hd, layer = K * head, at = (size_t)p->pos[b] * hd;
                char *kc = (char *)p->kc[b] + (l * layer + at) * csz, *vc = (char *)p->vc[b] + (l * layer + at) * csz;
                cache_write(k, v, K, hd, kc, vc, head, ct);
            }
#pragma omp for collapse(2) schedule(static)
            for (int b = 0; b < B; b++)
                for (int hh = 0; hh < H; hh++) {   /* scores: row b's query head hh against its own cache */
                    const int S = p->pos[b] + 1;
                    const long head = (long)p->max_len[b] * hd;
                    head_scores(qkv + b * qkv_n + (long)hh * hd,
                                (char *)p->kc[b] + (l * K * head + (hh / G) * head) * csz, S, hd, p->scale,
                                scores + (long)b * H * longest + (long)hh * S, wt, ct);
                }
            if (p->stats) {
#pragma omp for schedule(static)
                for (int b = 0; b < B; b++)
                    BAD(b, stats7(scores + (long)b * H * longest, (long)H * (p->pos[b] + 1), ST(b, s0 + 6)));
            }
#pragma omp for collapse(2) schedule(static)
            for (int b = 0; b < B; b++)
                for (int hh = 0; hh < H; hh++) {   /* softmax, weighted values */
                    const int S = p->pos[b] + 1;
                    const long head = (long)p->max_len[b] * hd;
                    head_softmax_values(scores + (long)b * H * longest + (long)hh * S, S,
                                        (char *)p->vc[b] + (l * K * head + (hh / G) * head) * csz, hd,
                                        z + ((long)b * H + hh) * hd, wt, ct);
                }
            if (p->stats) {
#pragma omp for schedule(static)
                for (int b = 0; b < B; b++) {
                    BAD(b, stats7(scores + (long)b * H * longest, (long)H * (p->pos[b] + 1), ST(b, s0 + 7)));
                    BAD(b, stats7(z + (long)b * H * hd, (long)H * hd, ST(b, s0 + 8)));
                }
            }
            product_rows(z, B, p->wo[l], H * hd, d, attn_out, part, wt);
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                float *xb = x + (long)b * d, *ab = attn_out + (long)b * d, *hb = h + (long)b * d;
                add_to(xb, ab, d, wt);
                rms_norm(xb, p->mlp_norm[l], d, p->eps, hb, wt);
                if (p->stats) {
                    BAD(b, stats7(ab, d, ST(b, s0 + 9)));
                    BAD(b, stats7(xb, d, ST(b, s0 + 10)));
                    BAD(b, stats7(hb, d, ST(b, s0 + 11)));
                }
            }
            product_rows(h, B, p->wgu[l], d, 2 * F, gu, part, wt);
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                const float *g2 = gu + 2L * b * F;
                float *ac = act + (long)b * F;
                for (int u = 0, T = omp_get_num_threads(); u < T; u++)    /* silu(g) * up, in decode.c's shares */
                    silu_mul(g2, g2 + F, ac, (long)F * u / T, (long)F * (u + 1) / T, wt);
                if (p->stats) {
                    BAD(b, stats7(g2, F, ST(b, s0 + 12)));
                    BAD(b, stats7(g2 + F, F, ST(b, s0 + 13)));
                    BAD(b, stats7(ac, F, ST(b, s0 + 14)));
                }
            }
            product_rows(act, B, p->wdown[l], F, d, mlp_out, part, wt);
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                float *xb = x + (long)b * d, *mb = mlp_out + (long)b * d;
                const float *ab = p->add ? p->add[(long)b * p->L + l] : NULL;
                add_to(xb, mb, d, wt);
                /* resid_post + the addition, rounded to wtype as the PyTorch forward's x + v.to(x.dtype); its
                 * statistics are those of the stream after it, as a replace hook's stage is recorded after the hook */
                if (ab) add_to(xb, ab, d, wt);
                if (p->stats) {
                    BAD(b, stats7(mb, d, ST(b, s0 + 15)));
                    BAD(b, stats7(xb, d, ST(b, s0 + 16)));
                }
            }
#pragma omp single
            if (p->marks) p->marks[1 + l] = omp_get_wtime() - t0;
        }
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            rms_norm(x + (long)b * d, p->final_norm, d, p->eps, xf + (long)b * d, wt);
            if (p->stats) BAD(b, stats7(xf + (long)b * d, d, ST(b, NS - 2)));
        }
        product_rows(xf, B, p->lm_head, d, V, p->logits, part, wt);
        if (p->stats) {
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) BAD(b, stats7(p->logits + (long)b * V, V, ST(b, NS - 1)));
        }
#pragma omp single
        if (p->marks) p->marks[p->L + 1] = omp_get_wtime() - t0;
    }
#undef ST
#undef BAD
    int n = 0;
    for (int b = 0; b < B; b++) n += p->bad[b] != 0;
    return n;
}
