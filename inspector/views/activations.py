"""Per-layer activation statistics from a run's StatsBlocks, non-finite cells, and the logit lens.

A StatsBlock holds, for one forward call, values[g, t] = STAT_NAMES statistics of stage names[g] at absolute
position pos0 + t (step 0 covers the prompt positions, each later step one position). Statistics over
several positions are pooled exactly, since every position of a stage has the same number of elements:
mean = mean of the means, RMS = sqrt(mean over positions of mean² + std²), std = sqrt(RMS² - mean²).
(For masked stages, attn.scores and sampler.*, the -inf entries are left out per position and positions
are weighted equally.)
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from engine import Probe
from engine.inspection.plans import split_name
from engine.inspection.stat_columns import Col, nonfinite, pool
from engine.progress import LayerProgress

from .theme import colorscale, robust_range

STATS = ("mean", "std", "absmax", "rms", "min", "max", "nan", "inf")


def rms(mean, std):
    """Root mean square of values with this mean and (population) std: sqrt(mean² + std²)."""
    return np.sqrt(np.asarray(mean, dtype=float) ** 2 + np.asarray(std, dtype=float) ** 2)


def _stat(values: torch.Tensor, stat: str) -> np.ndarray:
    """values (..., 7) -> (...) one statistic (rms derived from mean and std)."""
    v = values.double().numpy()
    return rms(v[..., Col.MEAN], v[..., Col.STD]) if stat == "rms" else v[..., Col[stat.upper()]]


def layer_stages(blocks) -> list[str]:
    """Per-layer stage names ('resid_post', 'attn.q', ...) in forward order."""
    seen: dict[str, None] = {}
    for b in blocks:
        for n, layer in zip(b.names, b.layers):
            if layer is not None:
                seen.setdefault(split_name(n)[1], None)
    return list(seen)


def layer_summary(blocks) -> pd.DataFrame:
    """One row per stage name (per layer and the layer-less ones: embed, final_norm, logits, sampler.*),
    its statistics pooled over every position of every step (engine.inspection.stat_columns.pool). Columns:
    stage, layer, name, positions, mean, std, rms, absmax, min, max, nan, inf."""
    p = pool((b.names, b.values) for b in blocks)
    if not p.names:
        return pd.DataFrame(columns=["stage", "layer", "name", "positions", *STATS])
    out = pd.DataFrame({"name": p.names, "positions": p.positions.numpy(),
                        **{k: p.cols[k].numpy() for k in ("mean", "std", "rms", "absmax", "min", "max", "nan",
                                                           "inf")}})
    split = [split_name(x) for x in out["name"]]
    out.insert(0, "layer", pd.array([lay for lay, _ in split], dtype="Int64"))
    out.insert(0, "stage", [s for _, s in split])
    return out.reset_index(drop=True)


def stage_table(summary: pd.DataFrame, stages: Sequence[str]) -> pd.DataFrame:
    """Rows of the chosen per-layer stages, ordered by stage then layer."""
    t = summary[summary["stage"].isin(list(stages)) & summary["layer"].notna()].copy()
    t["_o"] = t["stage"].map({s: i for i, s in enumerate(stages)})
    return t.sort_values(["_o", "layer"]).drop(columns="_o").reset_index(drop=True)


def lines_figure(table: pd.DataFrame, stat: str, *, log_y: bool = False) -> go.Figure:
    """One line per stage: the statistic across layers."""
    fig = go.Figure()
    for stage, t in table.groupby("stage", sort=False):
        fig.add_trace(go.Scatter(x=t["layer"].astype(int), y=t[stat], mode="lines+markers", name=stage))
    fig.update_xaxes(title="layer", dtick=1 if len(table) and table["layer"].max() < 40 else None)
    fig.update_yaxes(title=stat, type="log" if log_y else "linear")
    fig.update_layout(height=380, margin=dict(l=10, r=10, t=30, b=10), legend=dict(orientation="h"))
    return fig


def position_layer(blocks, stage: str, stat: str, num_layers: int) -> pd.DataFrame:
    """Positions (rows, every step's positions) × layers (columns) of one statistic of one per-layer stage."""
    cells: dict[int, np.ndarray] = {}
    for b in blocks:
        for g, (n, layer) in enumerate(zip(b.names, b.layers)):
            if layer is None or split_name(n)[1] != stage:
                continue
            col = _stat(b.values[g], stat)                                      # (T,)
            for t, x in enumerate(col):
                cells.setdefault(b.pos0 + t, np.full(num_layers, np.nan))[layer] = x
    pos = sorted(cells)
    return pd.DataFrame([cells[p] for p in pos], index=pd.Index(pos, name="position"),
                        columns=pd.Index(range(num_layers), name="layer"))


def nonfinite_cells(blocks) -> pd.DataFrame:
    """Every (step, position, stage) holding NaN or Inf, in forward order, with the counts."""
    rows = []
    for b in blocks:
        bad = nonfinite(b.values)                                                   # (G, T)
        for g, t in bad.nonzero().tolist():
            n = b.names[g]
            rows.append({"step": b.step, "position": b.pos0 + t, "name": n, "stage": split_name(n)[1],
                         "layer": b.layers[g], "nan": int(b.values[g, t, Col.NAN]),
                         "inf": int(b.values[g, t, Col.INF])})
    return pd.DataFrame(rows, columns=["step", "position", "name", "stage", "layer", "nan", "inf"])


MAX_POSITIONS = 256        # positions a position × layer heatmap shows at once
SIGNED = ("mean", "min", "max")


def position_window(positions: Sequence[int], bad: pd.DataFrame | None = None, size: int = MAX_POSITIONS) -> int:
    """Default first index of a window of `size` positions: centred on the first NaN/Inf cell when there is
    one (that is what a user opens this for), else the last `size` positions."""
    pos = list(positions)
    if len(pos) <= size:
        return 0
    if bad is not None and len(bad):
        i = pos.index(int(bad.iloc[0]["position"])) if int(bad.iloc[0]["position"]) in pos else len(pos) - size
        return max(0, min(i - size // 2, len(pos) - size))
    return len(pos) - size


def colour_range(z: np.ndarray, stat: str, skip_first: bool = True) -> tuple[float, float]:
    """Colour range of a layers × positions matrix: robust quantiles of the finite cells, leaving out the
    first column (position 0, whose massive activations dwarf every other position) when asked. Signed
    statistics get a range symmetric about 0, so white means zero."""
    body = z[:, 1:] if skip_first and z.shape[1] > 1 else z
    lo, hi = robust_range(body, 0.99)
    if stat in SIGNED:
        m = max(abs(lo), abs(hi), 1e-12)
        return -m, m
    return lo, hi


def position_layer_figure(matrix: pd.DataFrame, labels: Sequence[str], stat: str,
                          bad: pd.DataFrame | None = None, *, start: int = 0, size: int = MAX_POSITIONS,
                          skip_first: bool = True) -> go.Figure:
    """Layers (y) × positions (x) heatmap of positions [start, start + size); token text on the x axis;
    a robust colour range (cells beyond it get the end colours); cells holding NaN/Inf marked with a red ✕."""
    matrix = matrix.iloc[start:start + size]
    pos = list(matrix.index)
    x = [labels[p] if p < len(labels) else str(p) for p in pos]
    z = matrix.to_numpy().T                                                     # (L, P)
    z = np.where(np.isfinite(z), z, np.nan)
    lo, hi = colour_range(z, stat, skip_first and bool(pos) and pos[0] == 0)
    fig = go.Figure(go.Heatmap(z=z, x=x, y=list(matrix.columns), zmin=lo, zmax=hi, colorbar=dict(title=stat),
                               colorscale=colorscale("RdBu_r" if stat in SIGNED else "Viridis"),
                               hovertemplate="%{x}<br>layer %{y}<br>" + stat + " %{z:.4g}<extra></extra>"))
    if bad is not None and len(bad):
        where = {p: i for i, p in enumerate(pos)}
        b = bad[bad["position"].isin(where)]
        tips = [f"{n}: nan {a}, inf {i}" for n, a, i in zip(b["name"], b["nan"], b["inf"])]
        fig.add_trace(go.Scatter(x=[x[where[p]] for p in b["position"]], y=b["layer"].astype(int), mode="markers",
                                 marker=dict(symbol="x", color="red", size=10), name="NaN/Inf", hovertext=tips))
    k = max(1, -(-len(x) // 48))
    fig.update_xaxes(title="position and token", type="category", tickangle=-60, tickmode="array",
                     tickvals=x[::k], ticktext=x[::k])
    fig.update_yaxes(title="layer", autorange="reversed")
    fig.update_layout(height=max(340, 14 * matrix.shape[1] + 160), margin=dict(l=10, r=10, t=30, b=10))
    return fig


def logit_lens(model, ids: Sequence[int], pos: int, k: int = 10, *, on_progress=None) -> pd.DataFrame:
    """Top-k next-token predictions read off every layer's residual stream at position `pos`: each
    blocks.{i}.resid_post through the final norm and lm_head (model.unembed). One forward of ids[:pos+1]
    capturing only that position. Columns: layer, rank, id, token, prob. on_progress(engine.progress.Progress)
    hears each block finish (engine.progress)."""
    if not 0 <= pos < len(ids):
        raise ValueError(f"position {pos} is outside 0..{len(ids) - 1}")
    probe = Probe().capture("blocks.*.resid_post", positions=[pos])
    ids_t = torch.as_tensor([int(i) for i in ids[:pos + 1]], dtype=torch.long)
    T, tell = len(ids_t), LayerProgress(on_progress, len(ids_t), model.config.num_layers)
    model.forward(ids_t, model.new_cache(T), probe, last_only=True, on_layer=tell.on_layer(0, T))
    tell.chunk_done(0, T)
    caps = sorted((c for c in probe.recording.captures if c.name.endswith(".resid_post")), key=lambda c: c.layer)
    resid = torch.cat([c.value for c in caps])                                 # (L, d)
    probs = torch.softmax(model.unembed(resid), dim=-1)                         # (L, V)
    top = torch.topk(probs, k, dim=-1)
    tok = model.tokenizer
    rows = [{"layer": c.layer, "rank": r, "id": int(i), "token": tok.decode([int(i)]), "prob": float(p)}
            for c, ps, ix in zip(caps, top.values, top.indices) for r, (p, i) in enumerate(zip(ps, ix))]
    return pd.DataFrame(rows, columns=["layer", "rank", "id", "token", "prob"])


def logit_lens_figure(lens: pd.DataFrame, k: int | None = None) -> go.Figure:
    """Layers (y) × rank (x): each cell the token's text, coloured by its probability."""
    t = lens if k is None else lens[lens["rank"] < k]
    prob = t.pivot(index="layer", columns="rank", values="prob")
    text = t.pivot(index="layer", columns="rank", values="token")
    shown = text.map(lambda s: repr(s)[1:-1][:10])
    fig = go.Figure(go.Heatmap(z=prob.to_numpy(), x=list(prob.columns), y=list(prob.index), text=shown.to_numpy(),
                               texttemplate="%{text}", colorscale=colorscale("Blues"), zmin=0, zmax=1,
                               hovertemplate="layer %{y} rank %{x}<br>%{text}<br>p=%{z:.4f}<extra></extra>"))
    fig.update_xaxes(title="rank", dtick=1)
    fig.update_yaxes(title="layer", autorange="reversed", dtick=1)
    fig.update_layout(height=max(300, 22 * len(prob) + 80), margin=dict(l=10, r=10, t=30, b=10))
    return fig
