"""Attention statistics and rows computed in query blocks equal those of the materialised matrices."""
from __future__ import annotations

import math

import pytest
import torch

from engine import Probe, plant
from engine.generate import generate
from engine.inspection.attention_blocks import AttentionView, release_workspace, workspace_elements
from engine.inspection.attention_stats import attention_view
from engine.inspection.reference_stats import dense_stats
from tests.helpers import reference_stats

NAN, INF = float("nan"), float("inf")
IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2683, 359, 253, 1345, 2114, 28, 731]
ATTN = ["blocks.*.attn.scores", "blocks.*.attn.pattern"]


def materialised(qh, keys, allowed):
    """The explicit path's scores and pattern, (H, T, S) each."""
    H, T, hd = qh.shape
    K, S, _ = keys.shape
    s = (qh.reshape(K, -1, hd) @ keys.transpose(1, 2)).view(H, T, S) * hd ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    return s, torch.softmax(s, -1)


def causal(T, S):
    return torch.arange(S)[None, :] <= (S - T + torch.arange(T))[:, None]


def assert_stats_close(got, ref, rtol=1e-5):
    """Equal to fp32 rounding: every statistic within rtol of the row's magnitude (its absmax), counts exact."""
    scale = ref[:, 4:5].abs().clamp(min=1e-30)
    assert torch.equal(got[:, 5:], ref[:, 5:])
    finite = torch.isfinite(ref[:, :5])
    assert torch.equal(finite, torch.isfinite(got[:, :5])) or torch.equal(got[:, :5].isnan(), ref[:, :5].isnan())
    err = ((got[:, :5] - ref[:, :5]).abs() / scale)[finite]
    assert err.numel() == 0 or float(err.max()) <= rtol, float(err.max())


def test_hand_checked_two_heads_three_positions():
    # one KV head, two query heads, head_dim 4 (scale 1/2); keys e0, e1, e0+e1
    keys = torch.tensor([[[1., 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]]])
    qh = torch.tensor([[[2., 0, 0, 0], [0, 2, 0, 0], [2, 2, 0, 0]],
                       [[0., 0, 0, 0], [4, 0, 0, 0], [0, 0, 0, 0]]])
    r = attention_view(qh, keys, None, 0, AttentionView(True, True), block_elements=4, min_rows=1)   # one row per block
    # row 0 sees key 0: scores 1 (head 0), 0 (head 1); row 1 sees keys 0,1: [0,1] and [2,0];
    # row 2 sees all: [1,1,2] and [0,0,0]
    rows = [[1., 0], [0, 1, 2, 0], [1, 1, 2, 0, 0, 0]]
    for t, vals in enumerate(rows):
        v = torch.tensor(vals, dtype=torch.float64)
        want = [v.min(), v.max(), v.mean(), v.std(correction=0), v.abs().max(), 0, 0]
        assert r.scores_stats[t].tolist() == pytest.approx([float(x) for x in want], rel=1e-6, abs=1e-7)
    # pattern row 0: head 0 [1, 0, 0], head 1 [1, 0, 0] over S = 3 -> six values
    e = math.e
    pat = [[1, 0, 0, 1, 0, 0], [1 / (1 + e), e / (1 + e), 0, e * e / (1 + e * e), 1 / (1 + e * e), 0],
           [e / (2 * e + e * e), e / (2 * e + e * e), e * e / (2 * e + e * e), 1 / 3, 1 / 3, 1 / 3]]
    for t, vals in enumerate(pat):
        v = torch.tensor(vals, dtype=torch.float64)
        want = [v.min(), v.max(), v.mean(), v.std(correction=0), v.abs().max(), 0, 0]
        assert r.pattern_stats[t].tolist() == pytest.approx([float(x) for x in want], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("H,K,hd,T,S,generic", [(4, 2, 16, 37, 37, False), (4, 2, 16, 10, 30, False),
                                                (6, 3, 8, 9, 20, True), (4, 2, 16, 1, 12, False),
                                                (9, 3, 64, 70, 70, False)])
@pytest.mark.parametrize("block", [64, 300, 1 << 20])
def test_blocks_equal_the_materialised_statistics_and_rows(H, K, hd, T, S, generic, block):
    g = torch.Generator().manual_seed(T * S + H)
    qh, keys = torch.randn(H, T, hd, generator=g) * 2, torch.randn(K, S, hd, generator=g)
    allowed = causal(T, S)
    mask = None if S == T else allowed
    if generic:
        allowed = torch.rand(T, S, generator=g) > 0.5
        allowed[:, 0] = True
        mask = allowed
    s, p = materialised(qh, keys, allowed)
    pos0 = 5
    rows_s, rows_p = [pos0 + 1, pos0 + T - 1, pos0 + T + 9], [pos0, pos0 + T // 2]
    r = attention_view(qh, keys, mask, pos0, AttentionView(True, True, rows_s, rows_p), block_elements=block,
                       min_rows=1)
    assert_stats_close(r.scores_stats, reference_stats(s.transpose(0, 1), masked=True))
    assert_stats_close(r.pattern_stats, reference_stats(p.transpose(0, 1)))
    keep_s = sorted({1, T - 1} & set(range(T)))
    torch.testing.assert_close(r.scores_rows, s[:, keep_s], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.pattern_rows, p[:, sorted({0, T // 2})], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["q", "k", "v_only"])
def test_non_finite_blocks_fall_back_to_exact_counts(where):
    g = torch.Generator().manual_seed(3)
    H, K, hd, T = 4, 2, 8, 12
    qh, keys = torch.randn(H, T, hd, generator=g), torch.randn(K, T, hd, generator=g)
    if where == "q":
        qh[1, 4, 2] = NAN
    elif where == "k":
        keys[0, 6, 1] = INF
    s, p = materialised(qh, keys, causal(T, T))
    r = attention_view(qh, keys, None, 0, AttentionView(True, True), block_elements=40, min_rows=1)
    ref_s, ref_p = dense_stats(s.transpose(0, 1).reshape(T, -1), True), dense_stats(p.transpose(0, 1).reshape(T, -1))
    assert torch.equal(r.scores_stats[:, 5:], ref_s[:, 5:]) and torch.equal(r.pattern_stats[:, 5:], ref_p[:, 5:])
    torch.testing.assert_close(r.scores_stats, ref_s, equal_nan=True)
    torch.testing.assert_close(r.pattern_stats, ref_p, equal_nan=True)
    if where != "v_only":
        assert float(r.scores_stats[:, 5:].sum()) > 0


def test_working_set_is_bounded_by_the_block_not_by_T_squared():
    H, K, hd, T = 4, 2, 8, 600
    qh, keys = torch.randn(H, T, hd), torch.randn(K, T, hd)
    release_workspace()
    attention_view(qh, keys, None, 0, AttentionView(True, True), block_elements=4096, min_rows=1)
    assert 0 < workspace_elements() <= 3 * max(4096, H * T) < H * T * T // 50     # a block (or a query row), a tile
    release_workspace()
    assert workspace_elements() == 0


# ---- in the model: a statistics-only probe takes the fused path and blocked statistics ----------------------
def test_model_statistics_only_probe_equals_materialised(tiny_model):
    stats = Probe().record_stats(ATTN)
    full = Probe().capture(ATTN)
    cache_a, cache_b = tiny_model.new_cache(len(IDS)), tiny_model.new_cache(len(IDS))
    for chunk in (IDS[:9], IDS[9:12], IDS[12:13], IDS[13:]):      # a prefill, a chunk after it, two decode steps
        tiny_model.forward(torch.tensor(chunk), cache_a, stats)
        tiny_model.forward(torch.tensor(chunk), cache_b, full)
    records = stats.recording.stat_records()
    assert len(records) == len(full.recording.captures) == 4 * 2 * tiny_model.config.num_layers
    for rec, cap in zip(records, full.recording.captures):
        assert (rec.name, rec.pos0) == (cap.name, cap.positions[0])
        ref = reference_stats(cap.value.transpose(0, 1), masked=cap.name.endswith("scores"))
        assert_stats_close(rec.values, ref)


def test_model_rows_capture_equals_the_full_capture(tiny_model):
    rows = Probe().capture(ATTN, positions=[0, 6, 13]).capture("blocks.1.attn.pattern", positions=[6])
    full = Probe().capture(ATTN)
    assert rows.need("blocks.0.attn.pattern") == 2 and full.need("blocks.0.attn.pattern") == 3
    tiny_model.logits(IDS, rows)
    tiny_model.logits(IDS, full)
    by_name = {c.name: c for c in full.recording.captures}
    assert len(rows.recording.captures) == len(full.recording.captures) + 1
    for c in rows.recording.captures:
        ref = by_name[c.name]
        assert c.positions == ([6] if c.value.shape[1] == 1 else [0, 6, 13])
        torch.testing.assert_close(c.value, ref.value[:, c.positions], rtol=1e-5, atol=1e-6)


def test_statistics_do_not_change_the_logits_at_all(tiny_model):
    plain = tiny_model.logits(IDS)
    assert torch.equal(tiny_model.logits(IDS, Probe().record_stats("*")), plain)


@pytest.mark.parametrize("stage,index,position", [("attn.v", 3, 5), ("attn.k_rot", 1, 5), ("attn.q_rot", 0, 7),
                                                  ("attn.v", 0, 0)])
def test_fused_path_keeps_non_finite_values_in_the_rows_that_read_them(tiny_model, stage, index, position):
    """Statistics only (fused kernel, guarded) and a full pattern capture (explicit attention) put the NaN in
    the same rows and columns of attn.z: nowhere before the planted position."""
    zs = []
    for probe in (Probe().record_stats(ATTN), Probe().capture(ATTN)):
        probe.replace(f"blocks.0.{stage}", plant(NAN, position=position, index=index)).capture("blocks.0.attn.z")
        tiny_model.logits(IDS, probe)
        zs.append(probe.recording.captured("blocks.0.attn.z")[0].value)
    assert torch.equal(zs[0].isnan(), zs[1].isnan())
    assert not zs[0][:position].isnan().any() and zs[0][position].isnan().any()
    torch.testing.assert_close(zs[0], zs[1], equal_nan=True)


def test_a_statistics_probe_sees_every_stage_at_every_step(tiny_model):
    probe = Probe().record_stats("*")
    generate(tiny_model, IDS[:5], max_new_tokens=3, ignore_eos=True, probe=probe)
    names = set(tiny_model.hook_names()) - {"tokenizer", "detokenizer"}
    for step in range(3):
        assert {r.name for r in probe.recording.stat_records() if r.step == step} == names


def test_statistics_in_a_gradient_forward(tiny_model):
    """grad=True (attribution): the blocked statistics observe, they neither fail nor join the graph."""
    tiny_model.logits(IDS, Probe().record_stats("*"))            # a workspace made in inference mode first
    leaf = {}

    def make_leaf(x, ctx):
        leaf["x"] = x.detach().clone().requires_grad_(True)
        return leaf["x"]
    probe = Probe().record_stats("*").replace("embed", make_leaf)
    out = tiny_model.forward(torch.tensor(IDS), tiny_model.new_cache(len(IDS)), probe, grad=True)
    out[-1].max().backward()
    assert leaf["x"].grad is not None and float(leaf["x"].grad.abs().sum()) > 0
    assert len(probe.recording.stat_records("blocks.1.attn.pattern")) == 1
    assert probe.recording.first_nonfinite() is None
