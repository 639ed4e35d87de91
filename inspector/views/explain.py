"""Explain a token: tables and figures for logit attribution (engine.tools.explain), activation patching
(engine.tools.patching) and input attribution (engine.tools.attribution).
Pure: results in, DataFrames and Figures out."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from engine.tools.attribution import METHODS, InputAttribution
from engine.tools.explain import Explanation
from engine.tools.patching import PatchingResult

DIVERGING = "RdBu"      # blue = positive (favours A / the head helps), red = negative; zmid 0
ATTN, MLP, EMBED = "#3b6fb6", "#e4572e", "#7a7a7a"
METHOD_LABELS = {"occlusion": "occlusion", "grad_x_input": "gradient × input", "random": "random order (mean)"}


LEGEND_ABOVE = dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0)
LABEL_PX = 7.5          # width of one character of a tick label (plotly's 12-px default font), for the margins


def _layout(fig: go.Figure, height: int) -> go.Figure:
    fig.update_layout(height=height, margin=dict(l=10, r=10, t=40, b=10))
    return fig


# ---- logit attribution -----------------------------------------------------------------------------------
# the terms that are not a layer's: the token's row, GPT-2's learned position, and the constants of a LayerNorm
# family's final norm and Phi's head (engine.tools.dla)
WHOLE = {"embed": "embedding", "positions": "positions", "final_norm.bias": "final norm bias",
         "lm_head.bias": "head bias"}
CONSTANTS = ("final_norm.bias", "lm_head.bias")


def _row(name: str, v: float) -> tuple:
    """(component, kind, layer, head, contribution) of one term of e.contributions."""
    if name in WHOLE:
        return name, WHOLE[name], None, None, v
    _, i, rest = name.split(".", 2)
    if rest.startswith("attn.head."):
        return name, "attention head", int(i), int(rest.rsplit(".", 1)[1]), v
    return name, {"attn.bias": f"L{i} attn bias"}.get(rest, "MLP"), int(i), None, v


def contributions_frame(e: Explanation) -> pd.DataFrame:
    """One row per term (embedding, positions, each head, each layer's attention bias, each MLP, the constants), in
    model order; the values sum to e.total."""
    rows = [_row(name, v) for name, v in e.contributions.items()]
    df = pd.DataFrame(rows, columns=["component", "kind", "layer", "head", "contribution"])
    df["sign"] = np.where(df["contribution"] >= 0, "+ favours A", "− favours B")
    return df


def expert_frame(e: Explanation) -> pd.DataFrame:
    """Mixture-of-experts layers: each chosen expert's share of its layer's MLP part of logit(A) - logit(B)."""
    rows = []
    for key, v in e.experts.items():
        _, layer, _, _, expert = key.split(".")
        rows.append({"layer": int(layer), "expert": int(expert), "share": v,
                     "layer's MLP part": e.mlp(int(layer))})
    return pd.DataFrame(rows, columns=["layer", "expert", "share", "layer's MLP part"])


def top_components(e: Explanation, n: int = 15) -> pd.DataFrame:
    """The n components with the largest |contribution|, largest first."""
    df = contributions_frame(e)
    return df.reindex(df["contribution"].abs().sort_values(ascending=False).index).head(n).reset_index(drop=True)


def _start(e: Explanation) -> float:
    """The stream's share before the first layer: the token's row and (GPT-2) its position's."""
    return e.contributions["embed"] + e.contributions.get("positions", 0.0)


def layer_frame(e: Explanation) -> pd.DataFrame:
    """Per layer: attention (all heads, and its output bias where it has one) and MLP contributions, and their
    running total from the embedding (and positions)."""
    df = pd.DataFrame({"layer": range(e.num_layers), "attention": [e.attn(i) for i in range(e.num_layers)],
                       "mlp": [e.mlp(i) for i in range(e.num_layers)]})
    df["cumulative"] = _start(e) + (df["attention"] + df["mlp"]).cumsum()
    return df


def layer_figure(e: Explanation) -> go.Figure:
    """Bars: each layer's attention and MLP contribution to logit(A) − logit(B) (and the terms that are no
    layer's); line: the running total, which ends at the sum of every term."""
    df = layer_frame(e)
    first = [n for n in ("embed", "positions") if n in e.contributions]
    last = [n for n in CONSTANTS if n in e.contributions]
    after = (df["cumulative"].iloc[-1] + pd.Series([e.contributions[n] for n in last]).cumsum()).tolist()
    fig = go.Figure([
        *(go.Bar(x=[n], y=[e.contributions[n]], name=WHOLE[n], marker_color=EMBED) for n in first),
        go.Bar(x=df["layer"].astype(str), y=df["attention"], name="attention", marker_color=ATTN),
        go.Bar(x=df["layer"].astype(str), y=df["mlp"], name="MLP", marker_color=MLP),
        *(go.Bar(x=[WHOLE[n]], y=[e.contributions[n]], name=WHOLE[n], marker_color=EMBED) for n in last),
        go.Scatter(x=[first[-1], *df["layer"].astype(str), *(WHOLE[n] for n in last)],
                   y=[_start(e), *df["cumulative"], *after],
                   name="running total", mode="lines+markers", line=dict(color="black", width=1)),
    ])
    fig.update_xaxes(title="layer", type="category")
    fig.update_yaxes(title="contribution to logit(A) − logit(B)")
    fig.update_layout(barmode="group", legend=dict(orientation="h"))
    return _layout(fig, 380)


def head_matrix(e: Explanation) -> np.ndarray:
    """(layers, heads) contributions of each head."""
    return np.array([[e.head(i, h) for h in range(e.num_heads)] for i in range(e.num_layers)])


def _diverging_heatmap(z: np.ndarray, x, y, *, title: str, xtitle: str, ytitle: str, ztitle: str,
                       hover: str) -> go.Figure:
    lim = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0
    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorscale=DIVERGING, zmid=0, zmin=-lim, zmax=lim,
                               colorbar=dict(title=ztitle), hovertemplate=hover + "<extra></extra>"))
    fig.update_xaxes(title=xtitle, type="category")
    fig.update_yaxes(title=ytitle, type="category", autorange="reversed")
    fig.update_layout(title=title)
    return _layout(fig, max(260, 18 * len(y) + 100))


def head_heatmap(e: Explanation) -> go.Figure:
    """Layers × heads: each head's direct contribution (blue favours A, red favours B)."""
    z = head_matrix(e)
    return _diverging_heatmap(z, list(range(e.num_heads)), list(range(e.num_layers)),
                              title="Direct contribution of each head", xtitle="head", ytitle="layer",
                              ztitle="logit diff", hover="layer %{y} head %{x}<br>%{z:+.4f}")


def sampler_frame(e: Explanation) -> pd.DataFrame:
    """A and B through the sampler chain; the first row is the model's raw logits."""
    rows = [{"stage": s.stage, "A value": s.value_a, "B value": s.value_b, "p(A)": s.prob_a, "p(B)": s.prob_b,
             "rank A": s.rank_a, "rank B": s.rank_b, "Δ(A−B)": s.d_diff, "Δp(A)": s.d_prob_a,
             "Δp(B)": s.d_prob_b, "order changed": s.order_changed, "removed": s.removed, "changed": s.changed}
            for s in e.sampler]
    return pd.DataFrame(rows)


def sampler_summary(e: Explanation) -> list[str]:
    """One sentence per sampler stage that changed anything about A or B."""
    out = []
    for s in e.sampler[1:]:
        if not s.changed:
            continue
        what = "swapped A and B" if s.order_changed else (f"removed {s.removed}" if s.removed else "changed")
        out.append(f"{s.stage}: {what} — p(A) {s.prob_a - s.d_prob_a:.4g} → {s.prob_a:.4g} ({s.d_prob_a:+.2g}), "
                   f"p(B) {s.prob_b - s.d_prob_b:.4g} → {s.prob_b:.4g} ({s.d_prob_b:+.2g}), "
                   f"ranks of A / B {s.rank_a} / {s.rank_b}")
    return out


# ---- activation patching -------------------------------------------------------------------------------
def patching_heatmap(r: PatchingResult, site: str, labels: Sequence[str]) -> go.Figure:
    """Layers × positions: p(target) with that one activation restored from the clean run."""
    z = np.array(r.grid[site])                                                  # (L, T)
    fig = go.Figure(go.Heatmap(z=z, x=list(labels), y=list(range(z.shape[0])), colorscale="Viridis",
                               zmin=0, zmax=max(r.p_clean, float(np.nanmax(z)), 1e-9),
                               colorbar=dict(title="p(target)"),
                               hovertemplate="layer %{y}<br>%{x}<br>p = %{z:.4g}<extra></extra>"))
    fig.update_xaxes(title="position (restored token)", type="category", tickangle=-60)
    fig.update_yaxes(title="layer", type="category", autorange="reversed")
    fig.update_layout(title=f"{site} restored: p({r.target_text!r}); clean {r.p_clean:.3g}, "
                            f"corrupted {r.p_corrupt:.3g}")
    return _layout(fig, max(300, 16 * z.shape[0] + 140))


def head_scan_heatmap(r: PatchingResult) -> go.Figure:
    """Layers × heads: change in logit(target) when the head is zeroed in the clean run."""
    z = np.array(r.head_scan)                                                   # (L, H)
    return _diverging_heatmap(z, list(range(z.shape[1])), list(range(z.shape[0])),
                              title=f"Zeroing one head: Δ logit({r.target_text!r})", xtitle="head",
                              ytitle="layer", ztitle="Δ logit", hover="layer %{y} head %{x}<br>Δ %{z:+.4f}")


def patching_top(r: PatchingResult, labels: Sequence[str], n: int = 10) -> pd.DataFrame:
    """The cells that restore the most probability, over every site."""
    rows = [(site, i, labels[t], p) for site, g in r.grid.items() for i, row in enumerate(g) for t, p in enumerate(row)]
    df = pd.DataFrame(rows, columns=["site", "layer", "position", "p(target)"])
    df["recovered"] = (df["p(target)"] - r.p_corrupt) / ((r.p_clean - r.p_corrupt) or 1.0)
    return df.sort_values("p(target)", ascending=False).head(n).reset_index(drop=True)


# ---- input attribution ---------------------------------------------------------------------------------
def attribution_frame(a: InputAttribution, labels: Sequence[str]) -> pd.DataFrame:
    """Per prompt token: each method's score and rank (1 = rests on it most)."""
    df = pd.DataFrame({"token": list(labels)})
    for m in METHODS:
        df[METHOD_LABELS[m]] = a.scores[m]
        rank = np.empty(len(labels), dtype=int)
        rank[a.order(m)] = np.arange(1, len(labels) + 1)
        df[f"rank ({METHOD_LABELS[m]})"] = rank
    return df


def attribution_figure(a: InputAttribution, labels: Sequence[str]) -> go.Figure:
    """Each method's scores, normalised by its largest |score| so the two can share an axis."""
    fig = go.Figure()
    for m, color in zip(METHODS, (ATTN, MLP)):
        s = np.asarray(a.scores[m], dtype=float)
        scale = float(np.abs(s).max()) or 1.0
        fig.add_bar(x=list(labels), y=s / scale, name=METHOD_LABELS[m], marker_color=color,
                    customdata=s, hovertemplate="%{x}<br>score %{customdata:.4g}<extra></extra>")
    fig.update_xaxes(title="prompt token", type="category", tickangle=-60, automargin=True)
    fig.update_yaxes(title="score / max |score|", automargin=True)
    fig.update_layout(barmode="group", legend=LEGEND_ABOVE)
    # room for the labels rotated 60°: below the axis, and left of it for the first one (it leans left)
    longest = max((len(s) for s in labels), default=1)
    first = len(labels[0]) if len(labels) else 1
    _layout(fig, 360 + int(LABEL_PX * longest * 0.87))
    fig.update_layout(margin=dict(l=max(60, int(LABEL_PX * first * 0.5) + 20), t=60,
                                  b=int(LABEL_PX * longest * 0.87) + 50))
    return fig


def deletion_figure(a: InputAttribution) -> go.Figure:
    """log p(target) as tokens are removed in each method's order (and a random order); lower area = the
    method found the tokens that matter sooner."""
    fig = go.Figure()
    for m, curve in a.deletion.items():
        label = f"{METHOD_LABELS.get(m, m)} (area {a.areas[m]:.3f})"
        fig.add_scatter(x=list(range(len(curve))), y=curve, mode="lines+markers", name=label,
                        line=dict(dash="dot" if m == "random" else "solid"))
    fig.update_xaxes(title="tokens removed (replaced by the neutral token)", automargin=True)
    fig.update_yaxes(title=f"log p({a.target_text!r})", automargin=True)
    fig.update_layout(legend=LEGEND_ABOVE)          # a legend below the plot sat on the x-axis title
    _layout(fig, 380)
    fig.update_layout(margin=dict(t=70, b=50))
    return fig
