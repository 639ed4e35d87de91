"""The statistics' fast paths give what the slow, obvious oracle gives: attention statistics combined for all
layers at the flush (with the exact path for the rows that need it), moments reused for a stage that offers
the very tensor the stage before did, masked stages without a masked entry, and the row order a flush reuses."""
from __future__ import annotations

import torch

from engine import Probe, plant
from engine.inspection import moment_stats
from engine.inspection.attention_blocks import AttentionView
from engine.inspection.attention_partials import PendingAttention, pending_attention
from engine.inspection.attention_stats import attention_view
from engine.inspection.moment_stats import moments as real_moments
from engine.inspection.stats import StatsBatcher
from tests.helpers import reference_stats

NAN, INF = float("nan"), float("inf")
IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2683, 359, 253, 1345, 2114, 28, 731]
ATTN = ["blocks.*.attn.scores", "blocks.*.attn.pattern"]


def close(got: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal to fp32 rounding relative to each row's magnitude (absmax); NaN/Inf counts exact."""
    assert torch.equal(got[:, 5:], ref[:, 5:])
    assert torch.equal(got[:, :5].isnan(), ref[:, :5].isnan())
    scale = ref[:, 4:5].abs().clamp(min=1e-30)
    ok = torch.isfinite(ref[:, :5])
    err = ((got[:, :5] - ref[:, :5]).abs() / scale)[ok]
    assert err.numel() == 0 or float(err.max()) <= rtol, float(err.max())


def test_attention_statistics_resolved_at_the_flush_equal_the_materialised_ones(tiny_model):
    """Statistics only: every layer's attention is combined at the flush, one prefill, a chunk after it and a
    decode step, in forward order between the other stages."""
    stats, full = Probe().record_stats("*"), Probe().capture(ATTN)
    caches = [tiny_model.new_cache(len(IDS)) for _ in range(2)]
    for chunk in (IDS[:9], IDS[9:13], IDS[13:]):
        for probe, cache in zip((stats, full), caches):
            tiny_model.forward(torch.tensor(chunk), cache, probe)
    records = [r for r in stats.recording.stat_records() if r.name.endswith(("attn.scores", "attn.pattern"))]
    assert [(r.name, r.pos0) for r in records] == [(c.name, c.positions[0]) for c in full.recording.captures]
    for rec, cap in zip(records, full.recording.captures):
        close(rec.values, reference_stats(cap.value.transpose(0, 1), masked=cap.name.endswith("scores")))
    names = [r.name for r in stats.recording.stat_records() if r.step == 0 and r.pos0 == 0]
    i = names.index("blocks.0.attn.scores")
    assert names[i - 1:i + 3] == ["blocks.0.attn.k_rot", "blocks.0.attn.scores", "blocks.0.attn.pattern",
                                  "blocks.0.attn.z"]


def test_a_nan_query_sends_its_rows_to_the_exact_path_at_the_flush(tiny_model):
    """A planted NaN makes the partial results unusable for the rows that read it: those rows, found once for
    all layers at the flush, come from the exact path and count the NaN like the materialised matrices."""
    got = []
    for probe in (Probe().record_stats(ATTN), Probe().capture(ATTN)):
        probe.replace("blocks.1.attn.q_rot", plant(NAN, position=6, index=3))
        tiny_model.logits(IDS, probe)
        got.append(probe)
    records, caps = got[0].recording.stat_records(), got[1].recording.captures
    assert len(records) == len(caps) == 4
    for rec, cap in zip(records, caps):
        ref = reference_stats(cap.value.transpose(0, 1), masked=cap.name.endswith("scores"))
        close(rec.values, ref)
    nan_rows = records[2].values[:, 5]                     # blocks.1.attn.scores: only position 6 holds NaN
    assert nan_rows.nonzero().flatten().tolist() == [6]


def test_pending_layers_resolve_together_like_one_at_a_time():
    g = torch.Generator().manual_seed(4)
    H, K, hd, T = 4, 2, 8, 20
    want = AttentionView(True, True)
    layers = [(torch.randn(H, T, hd, generator=g), torch.randn(K, T + 5, hd, generator=g)) for _ in range(3)]
    layers[1][1][0, 7, 2] = INF                                          # one layer needs the exact path
    mask = torch.arange(T + 5)[None, :] <= (5 + torch.arange(T))[:, None]   # a chunk after 5 cached positions
    pending = [pending_attention(q, k, 5, want) for q, k in layers]
    PendingAttention.resolve(pending)
    for (q, k), pa in zip(layers, pending):
        one = attention_view(q, k, mask, 5, want)
        torch.testing.assert_close(pa.values[0], one.scores_stats, equal_nan=True)
        torch.testing.assert_close(pa.values[1], one.pattern_stats, equal_nan=True)


def test_a_stage_offering_the_same_tensor_reuses_its_moments_and_stays_exact(monkeypatch):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(60_000, generator=g)
    x[:10] = -INF                                                        # masked entries (a sampler cut)
    y = torch.randn(60_000, generator=g)
    taken = []
    monkeypatch.setattr(moment_stats, "moments", lambda X, *a: taken.append(X) or real_moments(X, *a))
    b = StatsBatcher()
    for name, t in (("a", x), ("b", x), ("c", x), ("d", y)):
        b.add(name, None, t, masked=True)
    assert len(taken) == 2 and taken[0].data_ptr() == x.data_ptr() and taken[1].data_ptr() == y.data_ptr()
    (block,) = b.take(0, 0)
    for g_, t in enumerate((x, x, x, y)):
        close(block.values[g_], reference_stats(t[None], masked=True))


def test_a_replace_hook_that_changes_the_tensor_in_place_is_not_served_stale_moments():
    x = torch.randn(50_000)
    b = StatsBatcher()
    b.add("a", None, x, masked=True)
    x.mul_(3.0)                                                          # what a replace hook may do
    b.forget_moments()
    b.add("b", None, x, masked=True)
    (block,) = b.take(0, 0)
    close(block.values[1], reference_stats(x[None], masked=True))


def test_masked_stages_with_and_without_masked_entries_equal_the_oracle():
    g = torch.Generator().manual_seed(6)
    clean = torch.randn(4, 9000, generator=g)                           # reduced when offered
    cut = clean.clone()
    cut[1, ::3] = -INF
    cut[2] = -INF                                                        # a fully masked row
    small = cut[:, :50].clone()                                          # reduced at the flush
    b = StatsBatcher()
    for i, t in enumerate((clean, cut, small, small[:, :20].clone().fill_(1.5))):
        b.add(f"s{i}", None, t, masked=True)
    (block,) = b.take(0, 0)
    for i, t in enumerate((clean, cut, small, small[:, :20].clone().fill_(1.5))):
        ref = reference_stats(t, masked=True)
        got = block.values[i]
        assert torch.equal(got[2].isnan(), ref[2].isnan()) if i in (1, 2) else True
        close(got, ref)


def test_a_flush_with_the_same_order_as_the_last_reuses_it_and_a_new_order_is_honoured(monkeypatch):
    g = torch.Generator().manual_seed(7)
    b = StatsBatcher()
    shapes = [(1, 5), (1, 7), (1, 5), (1, 40_000), (1, 7)]
    for _ in range(2):
        xs = [torch.randn(*s, generator=g) for s in shapes]
        for i, x in enumerate(xs):
            b.add(f"s{i}", i, x)
        (block,) = b.take(0, 0)
        for i, x in enumerate(xs):
            close(block.values[i], reference_stats(x))
    index = b._order[2]
    xs = [torch.randn(*s, generator=g) for s in shapes[::-1]]
    for i, x in enumerate(xs):
        b.add(f"s{i}", i, x)
    (block,) = b.take(0, 0)
    assert b._order[2] is not index
    for i, x in enumerate(xs):
        close(block.values[i], reference_stats(x))
