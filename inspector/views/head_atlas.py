"""Tables and figures of a head atlas (engine.tools.head_atlas): one row per head with every score, and a scatter of
two chosen scores, one point per head coloured by layer."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from engine.tools.head_atlas import SCORE_NAMES

SNIPPET = 80       # characters of a head's top text shown in the table


def atlas_table(atlas) -> pd.DataFrame:
    """layer, head, each score, and the opening of the text where its previous-token score is highest."""
    df = pd.DataFrame(atlas.rows())
    top = df.pop("top text (previous-token)")
    df.pop("top text (duplicate-token)")
    df["top text (previous-token)"] = [atlas.texts[i][:SNIPPET] for i in top]
    return df[["layer", "head", *SCORE_NAMES, "top text (previous-token)"]]


def atlas_figure(df: pd.DataFrame, x: str, y: str) -> go.Figure:
    """One point per head at (score x, score y), coloured by layer; hover names the head and both scores."""
    text = [f"L{int(layer)}H{int(head)}" for layer, head in zip(df["layer"], df["head"])]
    fig = go.Figure(go.Scatter(
        x=df[x], y=df[y], mode="markers", text=text,
        marker=dict(color=df["layer"], colorscale="Viridis", size=9, colorbar=dict(title="layer"),
                    line=dict(width=0.5, color="white")),
        hovertemplate=f"%{{text}}<br>{x} %{{x:.3f}}<br>{y} %{{y:.3f}}<extra></extra>"))
    fig.update_xaxes(title=x)
    fig.update_yaxes(title=y)
    fig.update_layout(title=f"Every head: {y} against {x}", height=460, margin=dict(l=10, r=10, t=40, b=10))
    return fig
