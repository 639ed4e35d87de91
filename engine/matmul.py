"""The model's matrix product: x (T, K) @ w (K, N), on the CPU in tiles of TILE rows, so that a row's result does
not depend on how many rows share the product (batch invariance, engine.batch).

MKL's product is not row-invariant in the row count T: a row's result depends on T (measured, torch 2.13, MKL,
float32: for K = 576 only T = 1 differs from larger T; for K = 1024 and 1536 every T up to 128-192 differs; for
K = 2048 and 3072, T <= 16), because the kernel MKL picks, and how it splits the K terms, changes with the shape.
With the shape fixed, a row's result is the same whatever row of the tile it is and whatever the other rows hold
(tested: every position of 8- and 16-row tiles, 7 shapes, one thread and two), and one batched call over tiles
(torch.bmm, w broadcast, not copied) gives each tile what the tile alone gives. So a product of at most TILED_ROWS
rows, and every product inside `tiled()` (a batched decode step, a packed prefill: engine.batch), takes x in tiles
of exactly TILE rows, the last padded with zero rows: a lone run's decode step and short prefill, a packed prefill of
several short prompts and a batched decode step compute each row by the same arithmetic, depending only on (TILE,
K, N). A longer product (a prompt's chunk of more than TILED_ROWS rows) is one MKL product, as before: such a prompt
is never packed with others (engine.batch.prefill), so it is computed the same way alone or beside other runs, at
the speed of an untiled product (tiles of 8 cost a 300-token prefill 1.9x).
TILE = 8, chosen by measurement (bundled model, PyTorch forward, one thread, CPU seconds, 2026-12-07): a 24-token
run 2.68 s with 8-row tiles, 2.96 s with 16, 3.47 s with 32; a 300-token prefill 1.05 s, 0.85 s, 0.79 s. The cost
of invariance on this path is real: without tiles (one MKL product of all rows, a lone row split between the
threads) the same run took 1.25 s and the prefill 0.55 s."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from engine.quant_matrix import QuantMatrix

TILE = 8          # rows a product takes at once on the CPU (see the module docstring)
TILED_ROWS = 32   # a product of at most this many rows is tiled (a lone decode step, a short prompt)
_state = threading.local()


@contextmanager
def tiled():
    """Inside: every CPU product is tiled whatever its rows (this thread's forwards: a batch of runs' rows)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


GRAD_ROWS = 4096  # rows of a QuantMatrix decoded at once for a gradient (an 8B head's: 64 MB of float32 a chunk)


class _QuantProduct(torch.autograd.Function):
    """x @ W for a QuantMatrix W (a constant: the model's weights), with the gradient for x that gradient x input
    needs (engine.tools.attribution) on a model kept quantised: dx = dy @ W^T, W's rows decoded GRAD_ROWS at a time
    (QuantMatrix.rows: the values its product uses), never the whole matrix in float32 (an 8B head's is 2.1 GB)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: QuantMatrix) -> torch.Tensor:
        ctx.w = w
        return w.matmul(x.detach())

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        w = ctx.w
        N, K = w.shape                                    # W's N rows of K values: x (T, K) @ W^T-layout (K, N)
        dx = dy.new_zeros(dy.shape[0], K)
        for start in range(0, N, GRAD_ROWS):
            stop = min(N, start + GRAD_ROWS)
            dx += dy[:, start:stop] @ w.rows(torch.arange(start, stop), dy.dtype)   # (T, n) @ (n, K)
        return dx, None


def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ w (K, N); on the CPU, in tiles of TILE rows when T <= TILED_ROWS or inside tiled() (row-invariant:
    the module docstring). A QuantMatrix
    (a GGUF matrix kept in its blocks) multiplies itself (QuantMatrix.matmul): this is the one place the model's
    products reach it."""
    if isinstance(w, QuantMatrix):
        return _QuantProduct.apply(x, w) if x.requires_grad else w.matmul(x)
    if x.device.type != "cpu" or x.dim() != 2 or (x.shape[0] > TILED_ROWS and not getattr(_state, "depth", 0)):
        return x @ w
    T, K = x.shape
    tiles = -(-T // TILE)
    if tiles * TILE != T:
        x = torch.cat([x, x.new_zeros(tiles * TILE - T, K)])
    out = torch.bmm(x.view(tiles, TILE, K), w.expand(tiles, *w.shape))       # (tiles, TILE, N)
    return out.view(tiles * TILE, -1)[:T]
