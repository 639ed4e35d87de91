"""inspector.views.activations: pooled per-layer statistics and the position × layer pivot on hand-built
StatsBlocks, NaN/Inf cells, and the logit lens on the tiny model."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from engine import STAT_NAMES, Probe, StatsBlock
from engine.inspection.interventions import plant
from inspector.views.activations import (
    layer_stages,
    layer_summary,
    lines_figure,
    logit_lens,
    logit_lens_figure,
    nonfinite_cells,
    position_layer,
    position_layer_figure,
    rms,
    stage_table,
)
from tests.helpers import reference_stats

NAN = float("nan")


def row(mean, std, lo=-1.0, hi=1.0, nan=0, inf=0):
    return [lo, hi, mean, std, max(abs(lo), abs(hi)), nan, inf]


def blocks():
    """A prefill of 2 positions and one decode step (position 2), for embed and 2 layers of resid_post."""
    prefill = StatsBlock(0, 0, ["embed", "blocks.0.resid_post", "blocks.1.resid_post"], [None, 0, 1],
                         torch.tensor([[row(1, 0), row(3, 0)],
                                       [row(0, 3, -4, 2), row(4, 0, 1, 5)],
                                       [row(1, 1), row(-1, 1, -9, 1)]]))
    decode = StatsBlock(1, 2, ["embed", "blocks.0.resid_post", "blocks.1.resid_post"], [None, 0, 1],
                        torch.tensor([[row(2, 0)], [row(3, 4, -7, 6)], [row(NAN, NAN, 0, 0, nan=5, inf=2)]]))
    return [prefill, decode]


def test_rms_from_mean_and_std():
    assert rms(3, 4) == 5
    np.testing.assert_allclose(rms([0, -1, 6], [2, 0, 8]), [2, 1, 10])


def test_layer_summary_pools_positions_exactly():
    s = layer_summary(blocks()).set_index("name")
    r0 = s.loc["blocks.0.resid_post"]
    # positions: (mean 0, std 3), (4, 0), (3, 4) -> mean 7/3, mean square (9 + 16 + 25) / 3
    assert r0["mean"] == pytest.approx(7 / 3)
    assert r0["rms"] == pytest.approx(math.sqrt(50 / 3))
    assert r0["std"] == pytest.approx(math.sqrt(50 / 3 - 49 / 9))
    assert (r0["min"], r0["max"], r0["absmax"], r0["positions"]) == (-7, 6, 7, 3)
    assert (r0["stage"], r0["layer"]) == ("resid_post", 0)
    r1 = s.loc["blocks.1.resid_post"]                    # the NaN position counts in nan/inf, not in the moments
    assert (r1["nan"], r1["inf"], r1["positions"]) == (5, 2, 3)
    assert r1["mean"] == pytest.approx(0) and r1["rms"] == pytest.approx(math.sqrt(2))
    emb = s.loc["embed"]
    assert emb["mean"] == pytest.approx(2) and emb["std"] == pytest.approx(math.sqrt(14 / 3 - 4))
    assert pd.isna(emb["layer"])
    assert layer_stages(blocks()) == ["resid_post"]


def test_pooled_statistics_equal_those_of_the_whole_tensor():
    """The pooling is exact: statistics of a real (positions, features) tensor computed per position by the
    engine's reference, then pooled, equal the statistics of all its values at once."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 50, generator=g) * torch.linspace(0.5, 3, 7)[:, None] + torch.arange(7.0)[:, None]
    b = [StatsBlock(0, 0, ["blocks.0.mlp_out"], [0], reference_stats(x[:5])[None]),
         StatsBlock(1, 5, ["blocks.0.mlp_out"], [0], reference_stats(x[5:])[None])]
    r = layer_summary(b).iloc[0]
    flat = x.double().flatten()
    assert r["mean"] == pytest.approx(float(flat.mean()), rel=1e-5)
    assert r["std"] == pytest.approx(float(flat.std(unbiased=False)), rel=1e-5)
    assert r["rms"] == pytest.approx(float(flat.square().mean().sqrt()), rel=1e-5)
    assert (r["min"], r["max"]) == pytest.approx((float(flat.min()), float(flat.max())))


def test_stage_table_filters_and_orders():
    b = [StatsBlock(0, 0, ["blocks.0.attn_out", "blocks.0.mlp_out", "blocks.1.attn_out", "blocks.1.mlp_out",
                           "final_norm"], [0, 0, 1, 1, None], torch.zeros(5, 1, 7))]
    t = stage_table(layer_summary(b), ["mlp_out", "attn_out"])
    assert t["name"].tolist() == ["blocks.0.mlp_out", "blocks.1.mlp_out", "blocks.0.attn_out", "blocks.1.attn_out"]
    fig = lines_figure(t, "rms")
    assert [tr.name for tr in fig.data] == ["mlp_out", "attn_out"] and list(fig.data[0].x) == [0, 1]
    assert stage_table(layer_summary(b), []).empty


def test_position_layer_pivot():
    m = position_layer(blocks(), "resid_post", "mean", num_layers=2)
    assert m.index.tolist() == [0, 1, 2] and m.columns.tolist() == [0, 1]
    np.testing.assert_array_equal(m.to_numpy(), [[0, 1], [4, -1], [3, NAN]])
    r = position_layer(blocks(), "resid_post", "rms", num_layers=3)           # a layer without records: NaN
    np.testing.assert_allclose(r.to_numpy()[:, 0], [3, 4, 5])
    assert r[2].isna().all()
    assert position_layer(blocks(), "attn_out", "mean", 2).empty


def test_nonfinite_cells_and_their_marks():
    bad = nonfinite_cells(blocks())
    assert bad.to_dict("records") == [{"step": 1, "position": 2, "name": "blocks.1.resid_post",
                                       "stage": "resid_post", "layer": 1, "nan": 5, "inf": 2}]
    assert nonfinite_cells(blocks()[:1]).empty
    m = position_layer(blocks(), "resid_post", "absmax", 2)
    fig = position_layer_figure(m, ["0 a", "1 b", "2 c"], "absmax", bad)
    assert np.asarray(fig.data[0].z).shape == (2, 3)
    assert list(fig.data[1].x) == ["2 c"] and list(fig.data[1].y) == [1]


def test_a_planted_nan_is_found_where_the_probe_says(tiny_model):
    ids = tiny_model.tokenizer.encode("one two three four five")
    p = Probe().record_stats("*").replace("blocks.1.mlp.act", plant(NAN, position=3, index=5))
    tiny_model.logits(ids, p)
    bad = nonfinite_cells(p.recording.stats)
    rec, pos = p.recording.first_nonfinite()
    assert (bad.iloc[0]["name"], bad.iloc[0]["position"]) == (rec.name, pos) == ("blocks.1.mlp.act", 3)
    assert (bad.iloc[0]["nan"], bad.iloc[0]["inf"]) == (1, 0)
    s = layer_summary(p.recording.stats).set_index("name")
    assert s.loc["blocks.1.mlp.act", "nan"] == 1 and s.loc["blocks.0.mlp.act", "nan"] == 0
    assert len(s) == len([n for n in tiny_model.hook_names() if n not in ("tokenizer", "detokenizer")
                          and not n.startswith("sampler.")])
    assert set(STAT_NAMES[:5]) <= set(s.columns)


def test_logit_lens_reads_every_layer(tiny_model):
    ids = tiny_model.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    pos, k = 6, 4
    lens = logit_lens(tiny_model, ids, pos, k)
    L = tiny_model.config.num_layers
    assert len(lens) == L * k and lens["layer"].tolist() == sum(([i] * k for i in range(L)), [])
    assert lens["rank"].tolist() == list(range(k)) * L
    # reference: every layer's resid_post from a full capture, unembedded by hand
    p = Probe().capture("blocks.*.resid_post")
    final = tiny_model.logits(ids[:pos + 1], p)[-1]
    for c in p.recording.captures:
        probs = torch.softmax(tiny_model.unembed(c.value[-1]), -1)
        top = torch.topk(probs, k)
        got = lens[lens["layer"] == c.layer]
        assert got["id"].tolist() == top.indices.tolist()
        np.testing.assert_allclose(got["prob"], top.values.numpy(), rtol=1e-4)
    last = lens[lens["layer"] == L - 1]
    assert last["id"].iloc[0] == int(final.argmax())                      # the last layer is the model's own choice
    assert last["token"].iloc[0] == tiny_model.tokenizer.decode([int(final.argmax())])
    fig = logit_lens_figure(lens, 2)
    assert np.asarray(fig.data[0].z).shape == (L, 2)
    with pytest.raises(ValueError):
        logit_lens(tiny_model, ids, len(ids), k)
    assert tiny_model.live_hooks == 0
