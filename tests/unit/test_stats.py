"""Batched per-position statistics against the slow, obvious oracle."""
from __future__ import annotations

import torch

from engine.stats import StatsBatcher, dense_stats
from tests.helpers import reference_stats

INF, NAN = float("inf"), float("nan")


def test_dense_stats_by_hand():
    x = torch.tensor([[1.0, -3.0, 2.0, 4.0]])
    out = dense_stats(x)[0]
    assert out.tolist() == [-3.0, 4.0, 1.0, float(torch.tensor([1.0, -3, 2, 4]).std(correction=0)), 4.0, 0.0, 0.0]


def test_nonfinite_and_masked_rows_match_reference():
    x = torch.tensor([[1.0, NAN, 2.0, INF], [-INF, -INF, 0.5, 1.5], [-INF, -INF, -INF, -INF], [3.0, 3.0, 3.0, 3.0]])
    for masked in (False, True):
        got = dense_stats(x, masked=masked)
        assert torch.allclose(got, reference_stats(x, masked=masked), equal_nan=True), masked
    m = dense_stats(x, masked=True)
    assert m[1].tolist()[:3] == [0.5, 1.5, 1.0] and m[1, 6] == 0          # masked -inf is not counted as Inf
    assert dense_stats(x)[1, 6] == 2


def test_batcher_groups_mixed_sizes_in_order():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, n, generator=g) * (i + 1) for i, n in enumerate([5, 7, 5, 1, 7])]
    xs[2][1, 3] = NAN
    b = StatsBatcher()
    for i, x in enumerate(xs):
        b.add(f"s{i}", i, x)
    (block,) = b.take(step=4, pos0=10)
    assert block.names == [f"s{i}" for i in range(5)] and (block.step, block.pos0) == (4, 10)
    for i, x in enumerate(xs):
        assert torch.allclose(block.values[i], reference_stats(x), rtol=1e-5, atol=1e-6, equal_nan=True)
