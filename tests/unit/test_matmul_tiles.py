"""engine.matmul.mm's two tile sizes keep each kind of row invariant, bit for bit: a short prompt's rows (2 to 32 of
them) multiplied alone equal the same rows inside a packed product (tiled(PREFILL_TILE)) at every offset, among other
rows of any values, on one thread and two; a one-row product equals its row inside a batched decode step's product
(tiled(DECODE_TILE)) at every position. The shapes are the bundled model's and the public shapes' (K, N), in float32
and bfloat16. The reference is the row's own product alone: a kernel whose result depended on the row's place in a
tile, or on its neighbours, fails here."""
from __future__ import annotations

import pytest
import torch

from engine.matmul import DECODE_TILE, PREFILL_TILE, TILED_ROWS, mm, tiled

pytestmark = pytest.mark.unit
SHAPES = [(576, 960), (1536, 576), (1024, 3072), (2048, 512)]


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,N", SHAPES)
def test_a_prompts_rows_alone_equal_them_inside_a_packed_product_at_every_offset(threads, K, N, dtype):
    g = torch.Generator().manual_seed(K + N)
    w = torch.randn(K, N, generator=g).to(dtype)
    for n in (2, 7, 17, TILED_ROWS):
        prompt = torch.randn(n, K, generator=g).to(dtype)
        alone = mm(prompt, w)
        for offset in (0, 1, 15, PREFILL_TILE - 1, 45):
            others = torch.randn(offset + n + 9, K, generator=g).to(dtype) * 50
            others[offset:offset + n] = prompt
            with tiled(PREFILL_TILE):
                packed = mm(others, w)
            assert torch.equal(packed[offset:offset + n], alone), (n, offset)


@pytest.mark.parametrize("K,N", SHAPES)
def test_a_one_row_product_equals_its_row_in_a_batched_decode_step(threads, K, N):
    g = torch.Generator().manual_seed(7 * K + N)
    w = torch.randn(K, N, generator=g)
    row = torch.randn(1, K, generator=g)
    alone = mm(row, w)
    for B, at in ((2, 1), (8, 5), (30, 0), (30, 29)):
        rows = torch.randn(B, K, generator=g) * 50
        rows[at] = row[0]
        with tiled(DECODE_TILE):
            batched = mm(rows, w)
        assert torch.equal(batched[at:at + 1], alone), (B, at)


def test_a_tiled_product_carries_its_gradient():
    """Explain's gradient x input takes the gradient through the model's products: over several tiles too, equal to
    the plain product's (the same tiles' sums; the gradient dy @ w^T per tile)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 40, generator=g)
    x = torch.randn(PREFILL_TILE + 5, 64, generator=g, requires_grad=True)
    y = mm(x, w)
    dy = torch.randn(y.shape, generator=g)
    (y * dy).sum().backward()
    assert torch.allclose(x.grad, dy @ w.t(), rtol=1e-5, atol=1e-5)
