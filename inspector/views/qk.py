"""Tables and figures of a QK attribution (engine.tools.qk_attribution's as_dict): its top pairs and its
components x components map grouped by layer."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from inspector.views.theme import colorscale


def pairs_table(d: dict) -> pd.DataFrame:
    return pd.DataFrame(d["top_pairs"], columns=["query side", "key side", "term"])


def groups_figure(d: dict) -> go.Figure:
    """Query-side group (y) x key-side group (x): each cell the sum of its terms (diverging around 0)."""
    z, labels = d["by_group"], d["groups"]
    top = max((abs(v) for row in z for v in row), default=1.0) or 1.0
    fig = go.Figure(go.Heatmap(z=z, x=labels, y=labels, zmin=-top, zmax=top, colorscale=colorscale("RdBu"),
                               colorbar=dict(title="term"),
                               hovertemplate="query side %{y}<br>key side %{x}<br>%{z:.4f}<extra></extra>"))
    fig.update_xaxes(title="key side (the attended position's components)", type="category", tickangle=-60)
    fig.update_yaxes(title="query side", type="category", autorange="reversed")
    fig.update_layout(title=f"score {d['score']:.4g} = Σ of the cells ({d['total']:.4g})",
                      height=min(900, 320 + 14 * len(labels)), margin=dict(l=10, r=10, t=40, b=10))
    return fig
