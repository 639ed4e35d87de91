/* The native steps' float products as entry points of their own: row_product.h's product (the lone step's,
 * decode.c) and product_rows (the batched step's, decode_rows.c), each called by a team of nth threads as the steps
 * call them, so that a test can hold every row of product_rows to the lone product bit for bit (batch invariance) at
 * shapes no model has: spans' and tiles' tails, thread shares of one block or none, more rows than a row block
 * (tests/unit/test_product_rows.py). Same header, same flags as the steps: the same code. */
#include <stdlib.h>

#include "row_product.h"

/* out (B, N) = x (B, K) @ W (K, N), W of type t (llama_ops.h), by product_rows (rows != 0) or by the lone product
 * one row at a time; 0, or -1 when the threads' scratch cannot be allocated */
int llmi_product_rows(const float *x, int B, const void *W, int K, int N, float *out, int t, int nth, int rows) {
    const long stride = rows ? (long)B * N : N + 16;
    float *part = malloc(sizeof(float) * ((size_t)nth * stride + 64));
    if (!part) return -1;
    if (rows) {
#pragma omp parallel num_threads(nth)
        product_rows(x, B, W, K, N, out, part, t);
    } else {
        for (int b = 0; b < B; b++) {
#pragma omp parallel num_threads(nth)
            product(x + (size_t)b * K, W, K, N, out + (size_t)b * N, part, stride, t, 0);
        }
    }
    free(part);
    return 0;
}
