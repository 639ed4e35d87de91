/* One decode step of several runs at once (CPU; weights in float32, bfloat16 or float16, as decode.c): B rows,
 * each one token of its own run, at its own position against its own KV cache, through every layer, the final norm
 * and the lm_head, in one call. The batched counterpart of decode.c's llmi_decode_step (engine/batch: the runs in
 * flight that decode together); engine/native/step.py calls it, and the PyTorch batched forward
 * (Model.forward_rows) stays the reference.
 *
 * Why: a batched step on the PyTorch path spent most of its time around the matrix products, in a few torch calls
 * per row per layer (each row's cache write, its padded keys, its statistics), ~4.5 ms a row a step for the
 * bundled model. Here the products read each weight once for all rows (chunks of column blocks split between
 * threads, an R x 16 register tile for eight rows at a time), and every per-row operation is a plain loop, rows spread
 * over the team.
 *
 * Statistics (optional): per row, the same stages in the same order as llmi_decode_step (embed, 17 per layer,
 * final_norm, logits), the same kernel (rowstat.h). bad[b] is set when row b meets a NaN or Inf; the call returns
 * how many rows did (the caller then redoes the step on the PyTorch path, which rewrites the same cache positions).
 */
#include <omp.h>
#include <stddef.h>

#include "llama_ops.h"
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
} Rows;

enum { PER_LAYER = 17 };               /* statistics rows a layer */

long llmi_rows_work_floats(int B, int d, int H, int K, int hd, int F, int longest) {
    return (long)B * (5L * d + (long)(H + 2 * K) * hd + (long)H * longest + (long)H * hd + 3L * F) + 64;
}

enum { ROWS = 8 };      /* rows a tile takes at once */

/* out[0:R] (row stride N), column blocks b .. b + C - 1 (C = 1, 2 or 4; a block is eight columns) = x[0:R] (row
 * stride Kd) @ those columns of W (Kd, N) of type t, row-major as the model stores it ((in, out): the step reads the
 * model's own matrices, no second copy): an R x 8C tile of float32 sums held in registers over all of Kd, each weight
 * vector loaded (and converted from bfloat16 / float16) once for the R rows (the usual register-blocked micro-kernel),
 * each sum rounded once to t when it is stored (the PyTorch matmul's output dtype). Inlined with R, C and t constant
 * (ROWS_CASES). Two column blocks' weights are one 16-wide vector, so that sixteen of a row's sums are one AVX-512
 * multiply-add (GCC's -march=native keeps its own loops at 256 bits on this CPU), and four blocks give 2 R independent
 * sums to hide the multiply-add's latency: each sum gets the same products in the same order as with 8-wide vectors.
 * A tile walks W's rows with a stride of N elements, 8 C elements a row; pf: the next chunk's columns (pf = W + 8
 * b_next elements), whose lines of row k are asked for with row k's weights (q: this tile's half of its chunk), so
 * that reading memory and multiplying overlap (see product_rows). */
LLMI_INLINE void tile(const int R, const int C, const int t, const float *x, int Kd, const void *W, int N, int b,
                      float *out, const void *pf, int q) {
    const size_t es = t == T_F32 ? 4 : 2;        /* bytes of an element */
    v16 acc[ROWS][2];
    v8 acc1[ROWS];
    for (int i = 0; i < R; i++) {
        if (C == 1) acc1[i] = (v8){0};
        else for (int j = 0; j < C / 2; j++) acc[i][j] = (v16){0};
    }
    for (int k = 0; k < Kd; k++) {
        const size_t w = (size_t)k * N + 8 * b;
        if (pf) {      /* half the next chunk's row k (a chunk: 8 blocks = 4 lines a row in fp32, 2 in 16 bits) */
            __builtin_prefetch((const char *)pf + ((size_t)k * N + 32 * q) * es, 0, 3);
            __builtin_prefetch((const char *)pf + ((size_t)k * N + 32 * q + 16) * es, 0, 3);
        }
        if (C == 1) {
            const v8 w0 = load8(W, w, t);
            for (int i = 0; i < R; i++) acc1[i] += x[(size_t)i * Kd + k] * w0;
            continue;
        }
        const v16 ww0 = load16(W, w, t);
        v16 ww1 = ww0;
        if (C == 4) ww1 = load16(W, w + 16, t);
        for (int i = 0; i < R; i++) {
            const float a = x[(size_t)i * Kd + k];
            acc[i][0] += a * ww0;
            if (C == 4) acc[i][1] += a * ww1;
        }
    }
    for (int i = 0; i < R; i++) {
        float *o = out + (size_t)i * N + 8 * b;
        if (C == 1) *(v8 *)o = acc1[i];
        else for (int j = 0; j < C / 2; j++) *(v16 *)(o + 16 * j) = acc[i][j];
        round_t(o, 8 * C, t);
    }
}

#define ROWS_CASES(C, T) \
    switch (nr) { \
    case 8: tile(8, C, T, xr, Kd, W, N, b, o, pf, q); break; \
    case 7: tile(7, C, T, xr, Kd, W, N, b, o, pf, q); break; \
    case 6: tile(6, C, T, xr, Kd, W, N, b, o, pf, q); break; \
    case 5: tile(5, C, T, xr, Kd, W, N, b, o, pf, q); break; \
    case 4: tile(4, C, T, xr, Kd, W, N, b, o, pf, q); break; \
    case 3: tile(3, C, T, xr, Kd, W, N, b, o, pf, q); break; \
    case 2: tile(2, C, T, xr, Kd, W, N, b, o, pf, q); break; \
    default: tile(1, C, T, xr, Kd, W, N, b, o, pf, q); \
    }

/* A tile of one or two column blocks (the end of a row of W when N / 8 is no multiple of 4: none of the
 * bundled model's products), not specialised for each row count (a smaller library, built faster). */
static __attribute__((noinline)) void tile_any(int R, int C, int t, const float *x, int Kd, const void *W, int N,
                                               int b, float *out) {
#define F(T) do { if (C == 2) tile(R, 2, T, x, Kd, W, N, b, out, 0, 0); else tile(R, 1, T, x, Kd, W, N, b, out, 0, 0); \
                } while (0)
    BY_TYPE(t, F);
#undef F
}

/* out (B, N) = x (B, Kd) @ W (Kd, N) of type t, row-major; every thread of the team calls it. A thread takes CHUNK
 * column blocks at a time and multiplies them for all rows, four column blocks and ROWS rows at a time (the chunk
 * stays in cache between the row blocks). Its first chunk it first asks for row by row (runs of CHUNK x 8 elements;
 * the tiles alone walk them with a stride the hardware prefetcher follows badly, and a step of a few rows was bound by
 * memory latency: the lm_head for 8 rows 9.5 ms, 5.0 ms with this); each next chunk it asks for while it multiplies
 * the one before, half a chunk's row with each row of its first row block's tiles (2 tiles a chunk), so that
 * reading memory and multiplying overlap (asked for whole before its products, a third of the products' time went to
 * waiting on the requests). Each weight is read from memory once a step, and no partial sums are added. */
enum { CHUNK = 8 };
LLMI_INLINE void product_rows_t(const float *x, int B, const void *W, int Kd, int N, float *out, const int t) {
    const int NB = N / 8;
    const size_t es = t == T_F32 ? 4 : 2;
    int first = 1;
#pragma omp for schedule(static)
    for (int b0 = 0; b0 < NB; b0 += CHUNK) {
        const int b1 = b0 + CHUNK < NB ? b0 + CHUNK : NB;
        if (first) {
            for (int k = 0; k < Kd; k++) {
                const char *w = (const char *)W + ((size_t)k * N + 8 * b0) * es;
                for (size_t l = 0; l < (size_t)(b1 - b0) * 8 * es; l += 64) __builtin_prefetch(w + l, 0, 3);
            }
            first = 0;
        }
        const void *next = b1 + CHUNK <= NB ? (const char *)W + (size_t)b1 * 8 * es : NULL;   /* a whole next chunk */
        for (int b = b0; b < b1;) {
            const int C = b + 4 <= b1 ? 4 : b + 2 <= b1 ? 2 : 1, q = (b - b0) / 4;
            for (int r0 = 0; r0 < B; r0 += ROWS) {
                const int nr = B - r0 < ROWS ? B - r0 : ROWS;
                const float *xr = x + (size_t)r0 * Kd;
                const void *pf = r0 == 0 && C == 4 ? next : NULL;
                float *o = out + (size_t)r0 * N;
                if (C == 4) {
                    ROWS_CASES(4, t)
                } else {
                    tile_any(nr, C, t, xr, Kd, W, N, b, o);
                }
            }
            b += C;
        }
    }
}
static void product_rows(const float *x, int B, const void *W, int Kd, int N, float *out, int t) {
#define F(T) product_rows_t(x, B, W, Kd, N, out, T)
    BY_TYPE(t, F);
#undef F
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
            product_rows(h, B, p->wqkv[l], d, (int)qkv_n, qkv, wt);
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
            product_rows(z, B, p->wo[l], H * hd, d, attn_out, wt);
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
            product_rows(h, B, p->wgu[l], d, 2 * F, gu, wt);
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                const float *g2 = gu + 2L * b * F;
                float *ac = act + (long)b * F;
                silu_mul(g2, g2 + F, ac, 0, F, wt);      /* silu(g) * up */
                if (p->stats) {
                    BAD(b, stats7(g2, F, ST(b, s0 + 12)));
                    BAD(b, stats7(g2 + F, F, ST(b, s0 + 13)));
                    BAD(b, stats7(ac, F, ST(b, s0 + 14)));
                }
            }
            product_rows(act, B, p->wdown[l], F, d, mlp_out, wt);
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                float *xb = x + (long)b * d, *mb = mlp_out + (long)b * d;
                add_to(xb, mb, d, wt);
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
        product_rows(xf, B, p->lm_head, d, V, p->logits, wt);
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
