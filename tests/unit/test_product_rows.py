"""The batched native step's product (row_product.h's product_rows, decode_rows.c's) against the lone step's (product,
decode.c's), called directly (engine/native/products.c): every row of a batch's product is torch.equal to that row's
lone product, in float32, bfloat16 and float16, on teams of two and three threads, at shapes that reach every tail of
product_rows's blocking (spans of columns whose width depends on the batch's size, tiles of 32 columns, a last tile
of 8 or 16 or of any width below, thread shares of W's rows of one block of eight or none, the last share's rows
past its blocks when K is not a multiple of eight, more rows than one row block of 32) -- batch
invariance at the product itself, where the end-to-end test (test_batch_invariance.py) sees only the bundled
model's shapes. Both are also the product x @ W itself: within the dtype's one rounding of the float64 product (and
float32's summing error), so two kernels agreeing on a wrong product fail too."""
from __future__ import annotations

import pytest
import torch

from engine.native import build

pytestmark = pytest.mark.unit

TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}      # llama_ops.h's T_F32, T_BF16, T_F16
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
ROWS = (1, 2, 3, 7, 8, 9, 30, 33)
# K: 2, 3 and 25 blocks of eight rows (a team of three splits two blocks 0 / 1 / 1: a thread with no rows);
# N: below a tile, tiles and a tail of 8, spans of 192 and a last span of 8, one row's span of 6,144 and 8 more
SHAPES = [(K, N) for K in (16, 24, 200) for N in (40, 200, 968, 6152)]
# any N (GPT-2's vocabulary of 50,257): a last tile of 3 columns (no vector), of 9 (eight and one), 13 and 11, a last
# span of 11; and any K: the last thread's rows past the blocks (K % 8 = 5, 5 and 3), after no block (K = 5: every
# other thread of the team has no rows), one and 25
ODD = [(K, N) for K in (5, 13, 203) for N in (3, 41, 205, 971, 6157)] + [(K, N) for K in (16, 200) for N in (41, 6157)]


def _lib():
    lib, why = build.load()
    if lib is None:
        pytest.skip(f"native library unavailable here: {why}")
    return lib


def _product(lib, x: torch.Tensor, w: torch.Tensor, nth: int, rows: bool) -> torch.Tensor:
    (B, K), N = x.shape, w.shape[1]
    out = torch.empty(B, N)
    assert lib.llmi_product_rows(x.data_ptr(), B, w.data_ptr(), K, N, out.data_ptr(), TYPES[w.dtype], nth,
                                 int(rows)) == 0
    return out


@pytest.mark.parametrize("nth", [2, 3])
@pytest.mark.parametrize("dtype", list(TYPES), ids=str)
def test_each_row_of_the_batched_product_is_the_lone_product(dtype, nth):
    lib, gen = _lib(), torch.Generator().manual_seed(46)
    for K, N in SHAPES + ODD:
        w = (torch.randn(K, N, generator=gen) * 0.1).to(dtype)
        x = torch.randn(max(ROWS), K, generator=gen)
        exact = x.double() @ w.double()
        slack = UNIT[dtype] * exact.abs() + 4 * K * 2.0 ** -24 * (x.abs().double() @ w.abs().double())
        lone = _product(lib, x, w, nth, rows=False)
        assert ((lone.double() - exact).abs() <= slack).all(), f"the lone product is not x @ W at K={K}, N={N}"
        for B in ROWS:
            got = _product(lib, x[:B].contiguous(), w, nth, rows=True)
            for b in range(B):
                assert torch.equal(got[b], lone[b]), \
                    (f"row {b} of {B} differs from its lone product at K={K}, N={N}, {dtype}, {nth} threads: "
                     f"{(got[b] - lone[b]).abs().max().item():.3g} at most, "
                     f"{(got[b] != lone[b]).sum().item()} of {N} columns")
