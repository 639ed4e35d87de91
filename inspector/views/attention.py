"""Attention maps for the Attention page: one layer's pattern computed on demand, the head average, a
layers × heads entropy overview, "where does this token look", and downsampling so a 2,048-token map
stays a few hundred cells a side.

Nothing here is stored per layer up front: a map costs one forward that materialises only the chosen
layer's pattern (and stops right after that layer), and the page memoises what it has shown (inspector.session.memo).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from engine import Probe
from engine.attention import allowed_keys
from engine.attention_math import attention_scores, softmax_pattern
from engine.progress import LayerProgress

from .theme import colorscale, robust_range

MAX_CELLS = 256      # most cells a side a heatmap shows; longer sequences are windowed or pooled
MAX_QUERIES = 256    # query rows the entropy overview evaluates per layer (all of them when fewer)


def attention_pattern(model, ids: Sequence[int], layer: int, *, on_progress=None) -> torch.Tensor:
    """Layer `layer`'s attention pattern over all positions of ids: float32 CPU (heads, T, T), rows sum to 1.

    One forward with a fresh cache: only this layer materialises its pattern (the others keep the fused
    kernel) and the forward stops after it (stop_after: this block's attention half), so later layers, its
    MLP and the lm_head cost nothing.
    on_progress(engine.progress.Progress) hears each of the layer + 1 blocks run finish (engine.progress)."""
    if not 0 <= layer < model.config.num_layers:
        raise ValueError(f"layer {layer} is outside 0..{model.config.num_layers - 1}")
    ids_t = torch.as_tensor([int(i) for i in ids], dtype=torch.long)
    name = f"blocks.{layer}.attn.pattern"
    probe = Probe().capture(name)
    T, tell = len(ids_t), LayerProgress(on_progress, len(ids_t), layer + 1)
    model.forward(ids_t, model.new_cache(T), probe, stop_after=name, on_layer=tell.on_layer(0, T))
    tell.chunk_done(0, T)
    (cap,) = probe.recording.captured(name)
    return cap.value.float()                                                  # (H, T, T)


def layer_label(layer_window: Sequence[int | None], layer: int) -> str:
    """'Layer 3', or where some layer attends within a sliding window, 'Layer 3 · local (window 4,096)' /
    'Layer 3 · global'."""
    if all(w is None for w in layer_window):
        return f"Layer {layer}"
    w = layer_window[layer]
    return f"Layer {layer} · " + ("global" if w is None else f"local (window {w:,})")


def outside_window(pattern: torch.Tensor, window: int) -> float:
    """The attention weight a (heads, T, T) pattern puts on keys `window` or more positions back of their
    query: 0 for a local layer of that window (the engine pads the positions before its window with 0)."""
    T = pattern.shape[-1]
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return float((pattern.abs() * (k <= q - window)).sum())


def head_view(pattern: torch.Tensor, head: int | None) -> np.ndarray:
    """(T, S) map of one head, or the mean over heads (head None); rows still sum to 1."""
    m = pattern.mean(0) if head is None else pattern[head]
    return m.double().numpy()


def row_entropy(pattern: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each attention row: (..., T, S) -> (..., T); 0·log 0 counts as 0."""
    return torch.special.entr(pattern.double()).sum(-1)


def query_rows(T: int, max_queries: int = MAX_QUERIES) -> torch.Tensor:
    """Query positions the overview evaluates: all when T <= max_queries, else evenly spaced incl. the last."""
    if T <= max_queries:
        return torch.arange(T)
    return torch.linspace(0, T - 1, max_queries).round().long().unique()


def entropy_overview(model, ids: Sequence[int], max_queries: int = MAX_QUERIES, *, on_progress=None) -> np.ndarray:
    """Mean attention entropy (nats) per (layer, head), (L, H), from one forward.

    No pattern is materialised: hooks on q_rot and k_rot (the fused attention path stays on) rebuild the
    softmax rows of up to max_queries query positions per layer, (H, R, T) at a time, with the engine's own
    scores and softmax (engine.attention_math: the family's scale and soft cap, GQA heads sharing a KV head) and
    mask (engine.attention.allowed_keys: causal, a local layer's window).
    Exact when T <= max_queries; otherwise a mean over evenly spaced query rows. on_progress as in
    attention_pattern, for every layer."""
    cfg = model.config
    T = len(ids)
    rows = query_rows(T, max_queries)
    q_of: dict[int, torch.Tensor] = {}
    out = torch.zeros(cfg.num_layers, cfg.num_heads, dtype=torch.float64)
    # which keys each query row reads: causal, and a local layer's window (engine.attention's mask)
    allowed = {w: allowed_keys(rows, 0, T, w) for w in set(cfg.layer_window)}               # (R, T) each

    def keep_q(x, ctx):
        q_of[ctx.layer] = x.index_select(0, rows.to(x.device)).float()        # (R, H, hd), on the device

    def on_k(x, ctx):
        qh, keys = q_of.pop(ctx.layer).transpose(0, 1), x.float().transpose(0, 1)      # (H, R, hd), (K, T, hd)
        scores = attention_scores(qh, keys, cfg.attn_scale, cfg.attn_softcap,
                                  allowed[cfg.layer_window[ctx.layer]].to(x.device))        # (H, R, T)
        pattern = softmax_pattern(scores)
        out[ctx.layer] = torch.special.entr(pattern).sum(-1).mean(-1).double().cpu()

    probe = Probe().replace("blocks.*.attn.q_rot", keep_q).replace("blocks.*.attn.k_rot", on_k)
    ids_t = torch.as_tensor([int(i) for i in ids], dtype=torch.long)
    tell = LayerProgress(on_progress, T, cfg.num_layers)
    model.forward(ids_t, model.new_cache(T), probe, last_only=True, on_layer=tell.on_layer(0, T))
    tell.chunk_done(0, T)
    return out.numpy()


def pool(m: np.ndarray, max_side: int = MAX_CELLS, how: str = "max") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Downsample a (T, S) map to at most max_side cells a side by blocks of b = ceil(n / max_side).

    how="max": the largest weight in each block (sharp, single-token attention stays visible).
    how="mass": mean over the block's query rows of the summed weight on its keys, so rows still sum to 1.
    Returns the pooled map and the first position of each row block and column block."""
    T, S = m.shape
    br, bc = max(1, math.ceil(T / max_side)), max(1, math.ceil(S / max_side))
    nr, nc = math.ceil(T / br), math.ceil(S / bc)
    fill = -np.inf if how == "max" else 0.0
    padded = np.full((nr * br, nc * bc), fill)
    padded[:T, :S] = m
    blocks = padded.reshape(nr, br, nc, bc)
    if how == "max":
        out = blocks.max(axis=(1, 3))
    elif how == "mass":
        counts = np.minimum(br, T - np.arange(nr) * br)                        # real rows per block
        out = blocks.sum(axis=3).sum(axis=1) / counts[:, None]
    else:
        raise ValueError(f"unknown pooling {how!r} (max or mass)")
    return out, np.arange(nr) * br, np.arange(nc) * bc


def window(m: np.ndarray, start: int, size: int = MAX_CELLS) -> tuple[np.ndarray, np.ndarray]:
    """Rows and columns [start, start + size) of a (T, S) map (clamped into range), and their positions."""
    n = m.shape[0]
    start = max(0, min(int(start), max(0, n - size)))
    pos = np.arange(start, min(n, start + size))
    return m[np.ix_(pos, pos)], pos


def clamp_start(start: int, n: int, size: int = MAX_CELLS) -> int:
    return max(0, min(int(start), max(0, n - size)))


def key_window(m: np.ndarray, rows: Sequence[int], size: int = MAX_CELLS, *, skip_sink: bool = True) -> int:
    """Where a window of `size` key positions holds the most of these query rows' attention: its first key.

    Position 0 (the attention sink: most heads park spare weight on the first token) is left out of the
    search, so the window goes where the head really looks; ties go to the latest window."""
    mass = np.asarray(m, dtype=float)[np.asarray(rows, dtype=int)].sum(0)
    if skip_sink and mass.size:
        mass[0] = 0.0
    if mass.size <= size:
        return 0
    c = np.concatenate([[0.0], np.cumsum(mass)])
    sums = c[size:] - c[:-size]                                      # window s holds mass[s:s + size]
    return int(np.flatnonzero(sums >= sums.max() - 1e-12)[-1])


def window_rows_cols(m: np.ndarray, q_start: int, k_start: int, size: int = MAX_CELLS, *,
                     hide_sink: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Query rows [q_start, q_start + size) × key columns [k_start, k_start + size) of a (T, S) map, both
    clamped into range; with hide_sink the key column of position 0 is left out. (z, rows, cols)."""
    T, S = m.shape
    rows = np.arange(clamp_start(q_start, T, size), min(T, clamp_start(q_start, T, size) + size))
    cols = np.arange(clamp_start(k_start, S, size), min(S, clamp_start(k_start, S, size) + size))
    if hide_sink:
        cols = cols[cols != 0]
    return m[np.ix_(rows, cols)], rows, cols


def mass_shown(m: np.ndarray, rows: Sequence[int], cols: Sequence[int]) -> tuple[float, float]:
    """(share of these rows' attention on the shown key columns, share on position 0), each in [0, 1]."""
    sub = np.asarray(m, dtype=float)[np.asarray(rows, dtype=int)]
    total = max(float(sub.sum()), 1e-30)
    return float(sub[:, np.asarray(cols, dtype=int)].sum()) / total, float(sub[:, 0].sum()) / total


def zmax_without_sink(z: np.ndarray, cols: Sequence[int]) -> float:
    """Top of the colour scale: a high quantile of the weights shown, position 0's column left out (the sink
    holds most of many heads' weight and would wash every other cell into the lowest colour)."""
    keep = [i for i, c in enumerate(cols) if int(c) != 0]
    body = np.asarray(z, dtype=float)[:, keep] if keep else np.asarray(z, dtype=float)
    return max(robust_range(body)[1], 1e-6)


def _ticks(labels: list[str], max_ticks: int = 48) -> dict:
    """Category tick labels thinned to at most max_ticks (every k-th), so each label stays readable."""
    k = max(1, -(-len(labels) // max_ticks))
    return dict(tickmode="array", tickvals=labels[::k], ticktext=labels[::k])


def heatmap_figure(z: np.ndarray, rows: Sequence[int], cols: Sequence[int], labels: Sequence[str], *,
                   title: str = "", block: int = 1, zmax: float | None = None) -> go.Figure:
    """Query (y) × key (x) heatmap at absolute positions; token text on both axes ("12 ·the", every k-th
    label when there are many) and on hover always. block > 1: each cell covers `block` positions (the
    label names its first and last). zmax: top of the colour scale (default: a robust high quantile of z,
    so one very large weight does not wash the rest out; cells above it get the top colour)."""
    rows, cols = list(map(int, rows)), list(map(int, cols))

    def lab(p: int) -> str:
        end = min(len(labels), p + block) - 1
        return labels[p] if block == 1 or end == p else f"{labels[p]} … {labels[end]}"

    # Categorical axes: labels start with the position, so they are unique and hover shows the token.
    ylab, xlab = [lab(p) for p in rows], [lab(p) for p in cols]
    top = robust_range(z)[1] if zmax is None else zmax
    fig = go.Figure(go.Heatmap(z=z, x=xlab, y=ylab, colorscale=colorscale("Viridis"), zmin=0, zmax=max(top, 1e-9),
                               colorbar=dict(title="weight"),
                               hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.4f}<extra></extra>"))
    fig.update_xaxes(title="key: position and token (what is attended to)", type="category", tickangle=-60,
                     **_ticks(xlab))
    fig.update_yaxes(title="query: position and token", type="category", autorange="reversed", **_ticks(ylab))
    fig.update_layout(title=title, height=min(900, 360 + 10 * len(rows)), margin=dict(l=10, r=10, t=40, b=10))
    return fig


def entropy_figure(ent: np.ndarray, layer_window: Sequence[int | None] | None = None) -> go.Figure:
    """Layers (y) × heads (x) heatmap of mean attention entropy; low = focused heads. With layer_window (some
    layer local), each layer's tick says local (window W) or global: a local layer's entropy is at most ln W."""
    L, H = ent.shape
    fig = go.Figure(go.Heatmap(z=ent, x=list(range(H)), y=list(range(L)), colorscale=colorscale("Magma"),
                               hovertemplate="layer %{y} head %{x}<br>entropy %{z:.3f} nats<extra></extra>",
                               colorbar=dict(title="nats")))
    fig.update_xaxes(title="head", dtick=1)
    fig.update_yaxes(title="layer", autorange="reversed")
    if layer_window is not None and any(w is not None for w in layer_window):
        fig.update_yaxes(tickvals=list(range(L)), ticktext=[f"{i} · " + ("global" if w is None else f"local {w:,}")
                                                            for i, w in enumerate(layer_window)])
    fig.update_layout(height=max(250, 18 * L + 80), margin=dict(l=10, r=10, t=30, b=10))
    return fig


def top_attended(m: np.ndarray, query: int, labels: Sequence[str], k: int = 10) -> pd.DataFrame:
    """The k key positions query `query` attends to most in map m (T, S), largest first."""
    row = np.asarray(m[query], dtype=float)
    order = np.argsort(-row, kind="stable")[:max(1, min(k, query + 1))]
    return pd.DataFrame({"position": order, "token": [labels[i] for i in order], "weight": row[order]})


def top_attended_figure(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure(go.Bar(x=df["weight"], y=df["token"], orientation="h",
                           hovertemplate="%{y}<br>weight %{x:.4f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(title="attention weight", range=[0, max(1e-9, float(df["weight"].max())) * 1.05])
    fig.update_layout(height=120 + 24 * len(df), margin=dict(l=10, r=10, t=10, b=10))
    return fig
