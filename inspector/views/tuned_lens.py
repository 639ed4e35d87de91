"""The logit lens and the tuned lens side by side (engine.tools.tuned_lens.lenses_at): each lens' top tokens per
layer as a DataFrame the Activations page's lens heatmap draws (inspector.views.activations.logit_lens_figure), and
each layer's KL to the model's final distribution, both lenses on one line chart."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

LENSES = ("logit lens", "tuned lens")
KL_COLUMNS = {"logit lens": "logit_lens", "tuned lens": "tuned_lens"}


def lens_tops(top_rows: list[dict], lens: str) -> pd.DataFrame:
    """One lens' rows of lenses_at's top rows: columns layer, rank, id, token, prob (the logit lens table's)."""
    t = pd.DataFrame([r for r in top_rows if r["lens"] == lens], columns=["lens", "layer", "rank", "id", "token",
                                                                          "prob"])
    return t.drop(columns="lens").reset_index(drop=True)


def kl_table(kl_rows: list[dict]) -> pd.DataFrame:
    """Columns layer, logit lens, tuned lens: each layer's KL (nats) to the final distribution."""
    t = pd.DataFrame(kl_rows, columns=["layer", "logit_lens", "tuned_lens"])
    return t.rename(columns={v: k for k, v in KL_COLUMNS.items()})


def kl_figure(table: pd.DataFrame, title: str = "KL to the final distribution") -> go.Figure:
    """One line per lens: KL (nats) against layer."""
    fig = go.Figure()
    for lens in LENSES:
        fig.add_trace(go.Scatter(x=table["layer"], y=table[lens], mode="lines+markers", name=lens,
                                 hovertemplate="layer %{x}<br>KL %{y:.3f} nats<extra>" + lens + "</extra>"))
    fig.update_xaxes(title="layer", dtick=1 if len(table) and table["layer"].max() < 40 else None)
    fig.update_yaxes(title="KL (nats)", rangemode="tozero")
    fig.update_layout(title=title, height=340, margin=dict(l=10, r=10, t=40, b=10), legend=dict(orientation="h"))
    return fig
