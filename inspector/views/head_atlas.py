"""Tables and figures of a head atlas (engine.tools.head_atlas): one row per head with every score, a scatter of
two chosen scores, one point per head coloured by layer, the head a click on it picks (checked), and a head's best
windows as token pieces with the scored and the attended token marked."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from engine import InputError
from engine.tools.head_atlas import SCORE_NAMES
from inspector.views.tokens import bytes_label, visible

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


BEFORE, AFTER = 10, 3      # tokens of context shown before and after a window's query position


def head_of_point(atlas, selection) -> tuple[int, int] | None:
    """The (layer, head) of the scatter point a plotly selection event picked (st.plotly_chart on_select: the
    figure's one trace has one point per head, in atlas.rows() order); None for an empty selection. Anything else
    the browser sends (another trace, an index off the chart, a point that is not a point) is refused by
    InputError: the event comes from a client and is not trusted."""
    points = selection.get("selection", {}).get("points") if isinstance(selection, dict) else None
    if points is None:
        raise InputError("the chart's selection is not a plotly selection event")
    if not isinstance(points, list):
        raise InputError("the chart's selection holds no list of points")
    if not points:
        return None
    point = points[0]
    index = point.get("point_index", point.get("point_number")) if isinstance(point, dict) else None
    if isinstance(point, dict) and point.get("curve_number", 0) != 0:
        raise InputError(f"the selected point is on trace {point.get('curve_number')!r}; the atlas has one")
    if type(index) is not int or not 0 <= index < atlas.layers * atlas.heads:
        raise InputError(f"the selected point {str(index)[:40]!r} is not one of the atlas's "
                         f"{atlas.layers * atlas.heads} heads")
    return divmod(index, atlas.heads)


def strongest_kind(atlas, layer: int, head: int, among=SCORE_NAMES) -> str:
    """Of the scores `among` (the Attention page: the scatter's two axes, what the user is looking at), the one
    on which this head stands highest among all heads: the share of heads it beats or ties (entropy: the lowest is
    the sharpest). Ties go to the first in `among`."""
    best, share = among[0], -1.0
    for name in among:
        s = atlas.scores[name]
        v = s[layer, head]
        if np.isnan(v):
            continue
        here = float(np.mean(s >= v) if name == "entropy" else np.mean(s <= v))
        if here > share:
            best, share = name, here
    return best


def window_pieces(atlas, tokenizer, name: str, layer: int, head: int) -> list[dict]:
    """One head's best windows by one score, each {rank, score, where, pieces}: pieces are (text, role) pairs, role
    "query" (the position scored), "key" (the position it attends for this score), "query key" (both: self) or ""
    for context; a key before the context shown comes first, then "…"."""
    out = []
    n_texts = len(atlas.text_ids)
    for w in atlas.top_windows(name, layer, head):
        ids, q, k, seq = w["ids"], w["query"], w["key"], w["sequence"]
        lo, hi = max(0, q - BEFORE), min(len(ids), q + AFTER + 1)
        text = lambda p: visible(bytes_label(tokenizer.token_bytes(int(ids[p]))))     # noqa: E731
        pieces = [(text(k), "key"), ("…", "")] if k < lo else []
        pieces += [(text(p), " ".join(r for r, at in (("query", q), ("key", k)) if at == p)) for p in range(lo, hi)]
        where = f"text {seq + 1}" if seq < n_texts else f"random sequence {seq - n_texts + 1}"
        out.append({"rank": w["rank"], "score": w["score"], "where": f"{where}, position {q} → {k}",
                    "pieces": pieces})
    return out
