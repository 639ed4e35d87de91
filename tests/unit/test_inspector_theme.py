"""The figures' shared style: colour scales that survive the chart theme's placeholder colours, log axes
labelled with whole numbers, the projector style, and every heatmap the inspector builds naming its scale."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from inspector.views import activations as act
from inspector.views import attention as att
from inspector.views import doctor as dv
from inspector.views import repetition as rv
from inspector.views import timeline as tl
from inspector.views.theme import (
    PLACEHOLDERS,
    PROJECTOR_LINE,
    PROJECTOR_TICKS,
    colorscale,
    log_ticks,
    placeholder_colours,
    robust_range,
    styled,
)


def test_magma_keeps_its_lowest_colour():
    # Magma's lowest colour is "#000004": the chart theme's placeholder for its 4th category colour (#ffabab)
    assert "#000004" in PLACEHOLDERS
    raw = go.Figure(go.Heatmap(z=[[0, 1]], colorscale="Magma"))
    assert placeholder_colours(raw) == ["#000004"]
    scale = colorscale("Magma")
    assert scale[0] == [0.0, "#010004"] and scale[-1][0] == 1.0 and len(scale) == 10
    assert not any(c in PLACEHOLDERS for _, c in scale)
    assert colorscale("Viridis")[0][1] == "#440154" and colorscale("Blues")[0][1] == "#f7fbff"
    assert placeholder_colours(styled(raw)) == [] and placeholder_colours(raw) == ["#000004"]   # a copy
    # the theme's own template is made of placeholders, which its colours replace: left exactly as it was
    themed = go.Figure(go.Scatter(y=[1, 2]), layout=dict(template=go.layout.Template(layout=dict(
        colorway=["#000001", "#000002"]))))
    assert styled(themed).layout.template.layout.colorway == ("#000001", "#000002")
    assert placeholder_colours(themed) == []


def test_log_axes_are_labelled_with_whole_numbers():
    vals, text = log_ticks(0.3, 60)
    assert text == ["0.5", "1", "2", "5", "10", "20", "50"] and vals == [0.5, 1, 2, 5, 10, 20, 50]
    _, text = log_ticks(1e-9, 10)                          # many decades: powers of ten only
    assert text[0] == "1e-9" and text[-1] == "10" and len(text) == 11
    fig = styled(go.Figure(go.Scatter(x=[1, 2, 3], y=[0.5, 5, 50]), layout=dict(yaxis_type="log")))
    assert fig.layout.yaxis.ticktext == ("0.5", "1", "2", "5", "10", "20", "50")


def test_projector_style_is_big_thick_and_taller():
    fig = go.Figure(go.Scatter(x=[1, 2], y=[1, 2], line=dict(width=1)), layout=dict(height=300))
    plain, big = styled(fig), styled(fig, projector=True)
    assert plain.layout.xaxis.tickfont.size == 12 and plain.data[0].line.width == 1
    assert big.layout.xaxis.tickfont.size == PROJECTOR_TICKS >= 16 and big.data[0].line.width == PROJECTOR_LINE
    assert big.layout.height == 405 and big.layout.font.size >= 18
    pale = go.Figure(go.Bar(x=[1], y=[1], marker_color="#c7d2e0"))
    assert styled(pale, projector=True).data[0].marker.color == "#8a94a6"     # pale grey darkened


def test_robust_range_ignores_a_few_extremes():
    z = np.tile(np.linspace(0, 0.02, 20), (20, 1))
    z[:, 0] = 0.9                                          # an attention sink: 5 % of the cells
    assert robust_range(z)[1] == 0.9                       # counted in, it sets the top of the scale ...
    assert robust_range(z[:, 1:])[1] == 0.02               # ... left out, the rest spans the colours
    lo, hi = robust_range(np.r_[np.linspace(0, 1, 1000), [1e6]])   # one outlier in a thousand
    assert 0 <= lo and hi < 1.01


def heatmaps_the_inspector_builds() -> dict[str, go.Figure]:
    m = np.tril(np.ones((6, 6)))
    m /= m.sum(1, keepdims=True)
    labels = [f"{i} t{i}" for i in range(6)]
    matrix = pd.DataFrame(np.arange(12.0).reshape(6, 2), index=pd.Index(range(6), name="position"))
    lens = pd.DataFrame([{"layer": i, "rank": r, "id": r, "token": "x", "prob": 0.1}
                         for i in range(2) for r in range(3)])
    marks = [(0, "start", 0.0), (0, "blocks.0", 0.1), (0, "blocks.1", 0.2), (1, "start", 0.0), (1, "blocks.0", 0.05),
             (1, "blocks.1", 0.1)]
    prec = pd.DataFrame({"stage": ["blocks.0.attn_out"], "layer": [0], "stage_in_layer": ["attn_out"],
                         "rel_err": [1e-3], "max_abs_err": [1.0], "ref_absmax": [2.0], "order": [0]})
    ca = rv.CopyAttention([3], [1], torch.rand(2, 3, 1), torch.rand(2, 3, 1))
    return {"attention map": att.heatmap_figure(m, range(6), range(6), labels),
            "attention entropy": att.entropy_figure(np.random.rand(2, 3)),
            "position x layer (rms)": act.position_layer_figure(matrix, labels, "rms"),
            "position x layer (mean)": act.position_layer_figure(matrix, labels, "mean"),
            "logit lens": act.logit_lens_figure(lens), "timeline": tl.layer_heatmap(tl.layer_durations(marks)),
            "precision": dv.precision_heatmap(prec), "copy attention": rv.copy_attention_figure(ca)}


def test_every_heatmap_names_an_explicit_scale_whose_lowest_colour_survives():
    for name, fig in heatmaps_the_inspector_builds().items():
        (heat,) = [t for t in fig.data if t.type == "heatmap"]
        scale = heat.colorscale
        assert isinstance(scale, tuple) and scale[0][0] == 0, name
        assert scale[0][1] not in PLACEHOLDERS and placeholder_colours(fig) == [], name
        assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text, name       # both axes say what


def test_attention_window_goes_where_the_head_looks():
    T, size = 600, 100
    m = np.zeros((T, T))
    m[:, 0] = 0.5                                          # the sink: half of every row
    for q in range(T):
        m[q, min(q, 150 + q % 40)] += 0.5                  # the rest on positions 150-189
    rows = range(T - size, T)
    k0 = att.key_window(m, rows, size)
    assert k0 <= 150 and k0 + size >= 190                  # the window covers where the weight is, not the end
    z, r, c = att.window_rows_cols(m, T - size, k0, size, hide_sink=k0 == 0)
    share, sink = att.mass_shown(m, r, c)
    assert sink == 0.5 and share >= 0.5 - 1e-9
    assert att.zmax_without_sink(m[np.ix_(r, c)], c) == 0.5
