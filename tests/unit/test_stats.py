"""Batched per-position statistics against the slow, obvious oracle."""
from __future__ import annotations

import pytest
import torch

from engine import Probe
from engine.accelerator import stats_backend
from engine.inspection.reference_stats import dense_stats
from engine.inspection.row_stats import PYTORCH
from engine.inspection.stat_sources import Given
from engine.inspection.stats import StatsBatcher
from tests.helpers import reference_stats

# Each batcher test runs on the PyTorch backend and on the one a CPU model gets (native where it is built).
BOTH = pytest.mark.parametrize("backend", [PYTORCH, stats_backend(torch.device("cpu"))], ids=["pytorch", "chosen"])

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


@BOTH
def test_batcher_groups_mixed_sizes_in_order(backend):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, n, generator=g) * (i + 1) for i, n in enumerate([5, 7, 5, 1, 7])]
    xs[2][1, 3] = NAN
    b = StatsBatcher(backend)
    for i, x in enumerate(xs):
        b.add(f"s{i}", i, x)
    (block,) = b.take(step=4, pos0=10)
    assert block.names == [f"s{i}" for i in range(5)] and (block.step, block.pos0) == (4, 10)
    for i, x in enumerate(xs):
        assert torch.allclose(block.values[i], reference_stats(x), rtol=1e-5, atol=1e-6, equal_nan=True)


@BOTH
def test_large_small_and_precomputed_stages_keep_forward_order(backend):
    """Large tensors are reduced when offered, small ones at the flush, precomputed rows pass through: one
    block, in the order offered, each equal to the oracle."""
    g = torch.Generator().manual_seed(1)
    T = 9
    xs = [torch.randn(T, n, generator=g) * 3 - 1 for n in (5000, 7, 5000, 64)]   # 45,000 elements: reduced at once
    xs[2][4, 17] = INF
    xs[3][2, 1] = NAN
    fixed = torch.arange(T * 7, dtype=torch.float32).view(T, 7)
    b = StatsBatcher(backend)
    for i, x in enumerate(xs[:2]):
        b.add(f"s{i}", i, x)
    b.add(["given"], [None], Given([fixed]))
    for i, x in enumerate(xs[2:], 2):
        b.add(f"s{i}", i, x, masked=i == 3)
    (block,) = b.take(step=0, pos0=3)
    assert block.names == ["s0", "s1", "given", "s2", "s3"]
    assert torch.equal(block.values[2], fixed)
    for row, x, masked in zip([0, 1, 3, 4], xs, [False, False, False, True]):
        assert torch.allclose(block.values[row], reference_stats(x, masked=masked), rtol=1e-5, atol=1e-5,
                              equal_nan=True), row


@BOTH
def test_a_mean_that_dwarfs_the_spread_still_gives_the_exact_std(backend):
    """Σx²/n - mean² would lose every digit here; such rows take the two-pass path."""
    g = torch.Generator().manual_seed(2)
    x = 100.0 + torch.randn(4, 50_000, generator=g)
    x[1] = torch.randn(50_000, generator=g)                     # an ordinary row next to them
    for big in (x, x[:, :300]):                                  # reduced when offered / at the flush
        b = StatsBatcher(backend)
        b.add("s", 0, big)
        (block,) = b.take(0, 0)
        got, ref = block.values[0], reference_stats(big)
        assert torch.allclose(got[:, 3], ref[:, 3], rtol=1e-5), (got[:, 3], ref[:, 3])
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


@BOTH
def test_views_of_one_product_share_its_reductions_and_stay_exact(backend):
    """q, k, v (pieces of each row of the fused qkv product) and gate, up are reduced in place as the
    strided views they are, in inference mode too, and equal the oracle like a contiguous tensor."""
    with torch.inference_mode():
        g = torch.Generator().manual_seed(3)
        qkv = torch.randn(100, 960, generator=g) * torch.linspace(0.1, 3, 960)
        q, k, v = qkv.view(100, 15, 64).split([9, 3, 3], dim=1)
        gate, up = (torch.randn(100, 3072, generator=g) - 0.5).chunk(2, dim=-1)
        xs = [q, k, v, gate, up, qkv]
        b = StatsBatcher(backend)
        for i, x in enumerate(xs):
            b.add(f"s{i}", 0, x)
        (block,) = b.take(0, 0)
    for i, x in enumerate(xs):
        assert torch.allclose(block.values[i], reference_stats(x), rtol=1e-5, atol=1e-5), i


def test_a_replace_hook_that_changes_a_view_in_place_is_seen(tiny_model):
    ids = [504, 3575, 282, 4649, 314, 7042, 30, 2683, 359, 253] * 110        # k: 35,200 values, reduced when offered

    def double_in_place(x, ctx):
        x.mul_(2.0)
    probe = Probe().record_stats("blocks.0.attn.*").replace("blocks.0.attn.k", double_in_place).capture(
        ["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v"])
    tiny_model.logits(ids, probe)
    for name in ("blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v"):
        (rec,) = probe.recording.stat_records(name)
        want = reference_stats(probe.recording.captured(name)[0].value)
        assert torch.allclose(rec.values, want, rtol=1e-5, atol=1e-5), name
