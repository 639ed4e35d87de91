"""The take-home report's charts as plotly figure specs: plain dicts ({"data": [...], "layout": {...}}) that
plotly.js draws with Plotly.newPlot. Built directly as JSON-able data (the engine imports no plotting
library); numbers are rounded for size, and NaN / ±Inf become null (a gap). Text from the run (tokens) is
HTML-escaped: plotly.js reads a few HTML tags in titles, ticks and hover text (links among them)."""
from __future__ import annotations

import math
from html import escape

import numpy as np

from engine.report.data import AttentionMap

PER_LAYER_SHOWN = ("attn_out", "mlp_out", "resid_post")   # lines visible at first; the others one click away
KEPT, MODEL, CHOSEN, LOOP = "#3b6fb6", "#9aa9bd", "#e4572e", "rgba(228,87,46,0.12)"
MAX_TICKS = 30
TICK_FONT = {"size": 12}      # the attention maps' position labels (they were drawn at 9 px)
HEAT = [[0.0, "#f7fbff"], [0.25, "#c6dbef"], [0.5, "#6baed6"], [0.75, "#2171b5"], [1.0, "#08306b"]]


def _layout(title: str, height: int = 360, **kw) -> dict:
    return {"title": {"text": title, "x": 0.01, "font": {"size": 15}}, "height": height,
            "margin": {"l": 60, "r": 20, "t": 40, "b": 50}, "font": {"family": "system-ui, sans-serif", "size": 12},
            "paper_bgcolor": "white", "plot_bgcolor": "white", "legend": {"orientation": "h", "y": -0.2}, **kw}


def rounded(xs, digits: int = 6) -> list:
    """Floats rounded to `digits` significant digits for the figure JSON; non-finite -> None."""
    out = []
    for x in xs:
        if x is None or not math.isfinite(float(x)):
            out.append(None)
        else:
            out.append(float(f"{float(x):.{digits}g}"))
    return out


def steps_figure(steps: list[dict], loops: list[dict]) -> dict:
    """Per step: the chosen token's probability under the sampler and under the model, and the model's entropy
    (right axis); loops shaded."""
    x = [s["step"] for s in steps]
    text = [f"{escape(s['token'])} (id {s['id']})" for s in steps]
    data = [
        {"type": "scatter", "mode": "lines+markers", "name": "chosen token: sampling prob", "x": x,
         "y": rounded(s["prob"] for s in steps), "text": text, "line": {"color": KEPT},
         "hovertemplate": "step %{x}: %{text}<br>p = %{y:.4f}<extra></extra>"},
        {"type": "scatter", "mode": "lines+markers", "name": "chosen token: model prob", "x": x,
         "y": rounded(s["model_prob"] for s in steps), "text": text, "line": {"color": MODEL, "dash": "dot"},
         "hovertemplate": "step %{x}: %{text}<br>model p = %{y:.4f}<extra></extra>"},
        {"type": "scatter", "mode": "lines", "name": "entropy (nats)", "x": x, "yaxis": "y2",
         "y": rounded(s["entropy"] for s in steps), "line": {"color": "#6a994e"},
         "hovertemplate": "step %{x}<br>entropy %{y:.3f} nats<extra></extra>"},
    ]
    shapes = [{"type": "rect", "xref": "x", "yref": "paper", "x0": lp["start"] - 0.5, "x1": lp["end"] - 0.5,
               "y0": 0, "y1": 1, "fillcolor": LOOP, "line": {"width": 0}, "layer": "below"} for lp in loops]
    return {"data": data, "layout": _layout(
        "Each step's chosen token" + (" (loops shaded)" if loops else ""), shapes=shapes,
        margin={"l": 60, "r": 70, "t": 40, "b": 50},
        xaxis={"title": {"text": "step"}}, yaxis={"title": {"text": "probability"}, "range": [0, 1.05]},
        yaxis2={"title": {"text": "entropy (nats)"}, "overlaying": "y", "side": "right", "rangemode": "tozero",
                "showgrid": False})}


def stats_figure(rows: list[dict], stat: str, *, log_y: bool) -> dict:
    """One line per per-layer stage: the statistic (pooled over all positions and steps) across layers."""
    by_stage: dict[str, list[dict]] = {}
    for r in rows:
        if r["layer"] is not None:
            by_stage.setdefault(r["stage"], []).append(r)
    data = []
    for stage, rs in by_stage.items():
        rs = sorted(rs, key=lambda r: r["layer"])
        data.append({"type": "scatter", "mode": "lines+markers", "name": stage, "x": [r["layer"] for r in rs],
                     "y": rounded(r[stat] for r in rs), "visible": True if stage in PER_LAYER_SHOWN else "legendonly",
                     "hovertemplate": f"{stage}<br>layer %{{x}}<br>{stat} %{{y:.4g}}<extra></extra>"})
    return {"data": data, "layout": _layout(
        f"{stat} by layer (click a stage in the legend to show or hide it)", height=420,
        xaxis={"title": {"text": "layer"}, "dtick": 1 if len(by_stage) and max(
            (r["layer"] for r in rows if r["layer"] is not None), default=0) < 40 else None},
        yaxis={"title": {"text": stat}, "type": "log" if log_y else "linear"})}


def _ticks(starts: list[int], labels: list[str], block: int) -> dict:
    every = max(1, -(-len(starts) // MAX_TICKS))
    vals = starts[::every]
    text = [escape(labels[p]) if block == 1 else f"{p}–{min(p + block, len(labels)) - 1}" for p in vals]
    return {"tickmode": "array", "tickvals": vals, "ticktext": text}


def attention_figure(m: AttentionMap, labels: list[str], n_prompt: int) -> dict:
    """Heatmap of one layer's head-averaged attention (queries down, keys across); the colour scale leaves
    position 0's column out (the attention sink would wash every other cell out); a line marks where the
    generated tokens begin."""
    z = np.round(m.z, 4)
    rest = z[:, 1:] if z.shape[1] > 1 else z
    finite = rest[np.isfinite(rest)]
    zmax = float(finite.max()) if finite.size and float(finite.max()) > 0 else 1.0
    zl = [[None if not math.isfinite(v) else v for v in row] for row in z.tolist()]
    what = "position" if m.block == 1 else f"block of {m.block} positions"
    heat = {"type": "heatmap", "z": zl, "x": m.starts, "y": m.starts, "colorscale": HEAT, "zmin": 0,
            "zmax": round(zmax, 4), "colorbar": {"title": {"text": "weight"}},
            "hovertemplate": f"query {what} %{{y}}<br>key {what} %{{x}}<br>weight %{{z:.4f}}<extra></extra>"}
    shapes = []
    if 0 < n_prompt < m.positions:
        edge = (n_prompt // m.block) * m.block - 0.5 * m.block if m.block > 1 else n_prompt - 0.5
        line = {"color": CHOSEN, "width": 1, "dash": "dot"}
        shapes = [{"type": "line", "xref": "x", "yref": "y", "x0": edge, "x1": edge, "y0": -0.5,
                   "y1": m.starts[-1] + m.block / 2, "line": line},
                  {"type": "line", "xref": "x", "yref": "y", "y0": edge, "y1": edge, "x0": -0.5,
                   "x1": m.starts[-1] + m.block / 2, "line": line}]
    ticks = _ticks(m.starts, labels, m.block)
    side = min(720, 260 + 2 * len(m.starts))
    return {"data": [heat], "layout": _layout(
        f"Layer {m.layer}: attention, average of all heads" + ("" if m.block == 1 else f" (pooled, {m.block} "
                                                                 "positions a cell)"),
        height=side + 120, shapes=shapes,
        xaxis={"title": {"text": "key position"}, "side": "bottom", **ticks, "tickangle": -60, "automargin": True,
               "tickfont": TICK_FONT},
        yaxis={"title": {"text": "query position"}, "autorange": "reversed", **ticks, "automargin": True,
               "tickfont": TICK_FONT})}


def sampling_figure(dist: dict) -> dict:
    """The candidates of one step: model probability beside sampling probability; the chosen token in red."""
    x = [f"{k + 1}. {escape(c['text']) or '∅'}" for k, c in enumerate(dist["candidates"])]
    colour = [CHOSEN if c["id"] == dist["chosen"] else KEPT for c in dist["candidates"]]
    ids = [c["id"] for c in dist["candidates"]]
    data = [{"type": "bar", "name": "model probability (softmax of the logits)", "x": x,
             "y": rounded(c["model_prob"] for c in dist["candidates"]), "marker": {"color": MODEL},
             "customdata": ids, "hovertemplate": "%{x} (id %{customdata})<br>model p = %{y:.4f}<extra></extra>"}]
    if any(c["sampling_prob"] is not None for c in dist["candidates"]):
        data.append({"type": "bar", "name": "sampling probability (run's settings)", "x": x,
                     "y": rounded(c["sampling_prob"] for c in dist["candidates"]), "marker": {"color": colour},
                     "customdata": ids,
                     "hovertemplate": "%{x} (id %{customdata})<br>sampling p = %{y:.4f}<extra></extra>"})
    return {"data": data, "layout": _layout(
        f"Step {dist['step']}: chose {escape(dist['chosen_text']) or '∅'} (id {dist['chosen']})", height=340,
        barmode="group", xaxis={"tickangle": -30, "automargin": True},
        yaxis={"title": {"text": "probability"}, "range": [0, 1.05]})}
