"""The model's matrix product: x (T, K) @ w (K, N), on the CPU in tiles of TILE rows, so that a row's result does
not depend on how many rows share the product (batch invariance, engine.batch).

MKL's product is not row-invariant in the row count T: a row's result depends on T (measured, torch 2.13, MKL,
float32: for K = 576 only T = 1 differs from larger T; for K = 1024 and 1536 every T up to 128-192 differs; for
K = 2048 and 3072, T <= 16), because the kernel MKL picks, and how it splits the K terms, changes with the shape.
With the shape fixed, a row's result is the same whatever row of the tile it is and whatever the other rows hold
(tests/unit/test_matmul_tiles.py: every offset, public shapes, one thread and two), and each tile is multiplied by a
call of its own (torch.mm into its rows of the output): one batched call over several tiles (torch.bmm) split its
work between two threads otherwise than one tile's call, so that a row at K = 1024 or 2048 differed from itself alone
on two threads (the bundled model's shapes happened not to). So a product of at most TILED_ROWS
rows, and every product inside `tiled()` (a batched decode step, a packed prefill: engine.batch), takes x in tiles
of exactly TILE rows, the last padded with zero rows: a lone run's decode step and short prefill, a packed prefill of
several short prompts and a batched decode step compute each row by the same arithmetic, depending only on (TILE,
K, N). A longer product (a prompt's chunk of more than TILED_ROWS rows) is one MKL product, as before: such a prompt
is never packed with others (engine.batch.prefill), so it is computed the same way alone or beside other runs, at
the speed of an untiled product (tiles of 8 cost a 300-token prefill 1.9x).
Two tile sizes, one for each kind of row, so that each kind pays the least for its invariance: a product of one row
(a decode step on the PyTorch forward) and a batched decode step's rows (engine.batch.step: each row one run's decode
step) take tiles of DECODE_TILE = 8 rows; a product of several rows (a short prompt's prefill alone, a packed prefill
of several prompts: engine.batch.prefill) tiles of PREFILL_TILE = 16. A row is only ever held to the same kind of
row (a run's decode step alone and batched, its prefill alone and packed); a prompt of one row, whose lone product
is a one-row product, is prefilled alone (engine.batch.prefill.prefill_reason). Chosen by measurement (bundled model,
PyTorch forward, one thread, CPU seconds, 2026-12-07): a 24-token run's decode 2.68 s with 8-row tiles, 2.96 s with
16, 3.47 s with 32. A packed prefill of 29 chat prompts (17-20 rows each, full inspection; three alternating rounds,
load 3.5): 2.54-2.63 s as one batched call over tiles of 8 (before the tiles had calls of their own), 3.25-3.63 s in
calls of 8 rows, 2.64-2.80 s of 16, 2.98-3.18 s of 32; the lone prompt's prefill 257-273 ms with 16 against 257-269
ms before. The cost of invariance on this path is real: without tiles (one MKL product of all rows, a lone row split
between the threads) the 24-token run took 1.25 s and a 300-token prefill 0.55 s against 1.05 s in tiles of 8."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from engine.quant_matrix import QuantMatrix

DECODE_TILE = 8     # rows a one-row product and a batched decode step's products take at once (the docstring)
PREFILL_TILE = 16   # rows a product of several rows takes at once (a short prompt's prefill, a packed prefill)
TILED_ROWS = 32     # a product of at most this many rows is tiled (a lone decode step, a short prompt)
_state = threading.local()


@contextmanager
def tiled(tile: int):
    """Inside: every CPU product is tiled, in tiles of `tile` rows (DECODE_TILE: a batched decode step's rows;
    PREFILL_TILE: a packed prefill's), whatever its rows (this thread's forwards: a batch of runs' rows)."""
    outer = getattr(_state, "tile", None)
    _state.tile = tile
    try:
        yield
    finally:
        _state.tile = outer


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
    """x (T, K) @ w (K, N); on the CPU, in tiles when T <= TILED_ROWS (DECODE_TILE rows for one row, PREFILL_TILE for
    several) or inside tiled() (its tile), row-invariant: the module docstring. A QuantMatrix (a GGUF matrix kept in
    its blocks) multiplies itself (QuantMatrix.matmul): this is the one place the model's products reach it."""
    if isinstance(w, QuantMatrix):
        return _QuantProduct.apply(x, w) if x.requires_grad else w.matmul(x)
    tile = getattr(_state, "tile", None)
    if x.device.type != "cpu" or x.dim() != 2 or (x.shape[0] > TILED_ROWS and tile is None):
        return x @ w
    T, K = x.shape
    tile = tile or (DECODE_TILE if T == 1 else PREFILL_TILE)
    tiles = -(-T // tile)
    if tiles * tile != T:
        x = torch.cat([x, x.new_zeros(tiles * tile - T, K)])
    if tiles == 1:
        return (x @ w)[:T]
    if x.requires_grad or w.requires_grad:      # a gradient (Explain's attribution): the same calls, differentiable
        return torch.cat([x[i * tile:(i + 1) * tile] @ w for i in range(tiles)])[:T]
    out = x.new_empty(tiles * tile, w.shape[1])
    for i in range(tiles):      # each tile its own product of one shape (a batched call splits its work otherwise)
        torch.mm(x[i * tile:(i + 1) * tile], w, out=out[i * tile:(i + 1) * tile])
    return out[:T]
