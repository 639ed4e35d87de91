"""The model's matrix product: x (T, K) @ w (K, N), with a one-row product on a multi-core CPU split so that every
thread reads its share of w (decode is bound by reading the weights)."""
from __future__ import annotations

import functools

import torch

from engine.quant_matrix import QuantMatrix


def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ w (K, N). One row on a multi-core CPU (decode, bound by reading w): MKL runs a one-row
    product on one thread, streaming at about half the machine's read bandwidth, so w is split into one
    chunk per thread, multiplied as a batch (MKL gives each its own thread) and put back together: a wide
    matrix (the lm_head) by column blocks, whose products are the output's pieces; any other by contiguous
    row blocks, whose partial products are added. A QuantMatrix (a GGUF matrix kept in its blocks) multiplies
    itself (QuantMatrix.matmul): this is the one place the model's products reach it."""
    if isinstance(w, QuantMatrix):
        return w.matmul(x)
    if x.shape[0] != 1 or x.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous():
        return x @ w        # (half precisions: partial products rounded to 16 bits would add error)
    K, N = w.shape
    threads = torch.get_num_threads()
    if N >= 8 * K:
        parts = _parts(N, threads)
        n = N // parts
        return torch.bmm(x.expand(parts, 1, K), w.as_strided((parts, K, n), (n, N, 1))).view(1, N)
    parts = _parts(K, threads)
    if parts == 1:
        return x @ w
    k = K // parts
    return torch.bmm(x.reshape(parts, 1, k), w.view(parts, k, N)).sum(0)


@functools.lru_cache(maxsize=64)
def _parts(rows: int, threads: int) -> int:
    """Chunks for a one-row product: the most, up to the thread count (at most 8), that divide `rows`."""
    return next(p for p in range(min(threads, 8), 0, -1) if rows % p == 0)
