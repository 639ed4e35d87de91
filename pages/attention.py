"""Attention: one layer's pattern (a head or the head average) over every position of the run, where one
token looks and why (its score split into query-side x key-side parts: inspector.ui.qk_panel), and an all-layers ×
heads entropy overview, and a head atlas (every head scored previous-token, sink, self, duplicate, induction:
inspector.ui.atlas_panel). Maps are computed on demand (one forward that
stops after the chosen layer) and memoised per run and layer in this session; generation never re-runs."""
import time

import streamlit as st

from inspector.session.memo import content_key, memo, view_store
from inspector.ui.common import on_demand, plain, require_run_and_model, was_stopped
from inspector.ui.frame import ensure_frame
from inspector.ui.atlas_panel import atlas_section
from inspector.ui.qk_panel import qk_section
from inspector.ui.state import session
from inspector.ui.widgets import chart, checked, shared, table
from inspector.views.attention import (
    MAX_CELLS,
    attention_pattern,
    entropy_figure,
    entropy_overview,
    head_view,
    heatmap_figure,
    key_window,
    layer_label,
    mass_shown,
    pool,
    top_attended,
    top_attended_figure,
    window_rows_cols,
    zmax_without_sink,
)
from inspector.views.tokens import token_labels

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

OVERVIEW_AUTO = 512   # longer runs compute the layers × heads overview only when asked


st.header("Attention")
run, model = require_run_and_model("compute its attention")
cfg, ids = model.config, run.ids
T, key = len(ids), content_key(run, model)     # a room's run: every student's session shares what is derived
labels = token_labels(model.tokenizer, ids)
maps = view_store(run, session().memo("att_maps"))
overviews = view_store(run, session().memo("att_overviews"))
figures = view_store(run, None)                # figures: shared for a room, else drawn afresh

c1, c2 = st.columns(2)
layer = c1.selectbox("Layer", list(range(cfg.num_layers)), key="att_layer",
                     format_func=lambda i: layer_label(cfg.layer_window, i),
                     **shared("att_layer", allowed=range(cfg.num_layers)))
head = c2.selectbox("Head", [None, *range(cfg.num_heads)], key="att_head",
                    format_func=lambda h: "Average of all heads" if h is None else f"Head {h}",
                    **shared("att_head", allowed=[None, *range(cfg.num_heads)]))

cached, t0 = (key, layer) in maps, time.perf_counter()
pattern = on_demand(maps, (key, layer), f"layer {layer}'s attention over {T:,} positions",
                    lambda tell: attention_pattern(model, ids, layer, on_progress=tell), work=(model, T, layer + 1),
                    max_entries=8)
if pattern is None:           # stopped: the page offers to compute it again
    st.stop()
elapsed = time.perf_counter() - t0
if cfg.windowed:
    n_local = sum(w is not None for w in cfg.layer_window)
    w = cfg.layer_window[layer]
    st.caption(f"{n_local} of {cfg.num_layers} layers are local (sliding window), the others global. " + (
        f"Layer {layer} is **local**: each query sees only itself and the {w - 1:,} positions before it, so the map "
        f"is a band {w:,} keys wide (everything further back is 0); its KV cache keeps just {w:,} rows."
        if w is not None else f"Layer {layer} is **global**: each query sees every earlier position."))
m = head_view(pattern, head)                                                    # (T, T)

what = "average of heads" if head is None else f"head {head}"
hide = st.toggle("Hide the attention sink (position 0)", False, key="att_hide_sink",
                 help="Most heads park spare attention on the first token. Its column is always left out of the "
                      "colour scale (it would wash every other cell out); this hides the column itself.")
if T <= MAX_CELLS:
    z, rows, cols = window_rows_cols(m, 0, 0, T, hide_sink=hide)
    block, shown = 1, ("all",)
    note = "Each row is a query position's attention over the key positions; rows sum to 1."
else:
    view = st.radio("Positions shown", ["Window", "Whole sequence, pooled"], horizontal=True, key="att_view")
    if view == "Window":
        w1, w2 = st.columns(2)
        q0 = checked(w1.slider("Queries from", 0, T - MAX_CELLS, T - MAX_CELLS, key="att_window"), 0,
                     T - MAX_CELLS, "Queries from")
        k_default = key_window(m, range(q0, q0 + MAX_CELLS), MAX_CELLS)
        k0 = checked(w2.slider("Keys from (default: where these queries look)", 0, T - MAX_CELLS, k_default,
                               key=f"att_key_window_{layer}_{head}"), 0, T - MAX_CELLS, "Keys from")
        z, rows, cols = window_rows_cols(m, q0, k0, MAX_CELLS, hide_sink=hide)
        share, sink = mass_shown(m, rows, cols)
        block, shown = 1, ("window", q0, k0)
        note = (f"Queries {rows[0]}–{rows[-1]} and keys {cols[0]}–{cols[-1]} of {T} positions: {share:.0%} of these "
                f"queries' attention falls on the keys shown ({sink:.0%} on position 0).")
    else:
        how = st.selectbox("Pooling", ["max", "mass"], key="att_pool",
                           format_func=lambda h: {"max": "max weight in each block",
                                                  "mass": "attention mass (rows still sum to 1)"}[h])
        src = m.copy()
        if hide:
            src[:, 0] = 0.0
        z, rows, cols = pool(src, MAX_CELLS, how)
        block, shown = (int(rows[1] - rows[0]) if len(rows) > 1 else 1), ("pooled", how)
        note = f"{T} positions pooled into blocks of {block} ({how})" + (
            "; position 0's weight left out, so rows sum to less than 1." if hide else ".")
chart(memo(figures, (key, "map", layer, head, hide, shown),
           lambda: heatmap_figure(z, rows, cols, labels, title=f"Layer {layer}, {what}", block=block,
                                  zmax=zmax_without_sink(z, cols)), max_entries=8), key="att_map")
st.caption(note + " Colours run from 0 to a high quantile of the weights off position 0; brighter cells are "
           "clipped to the top colour." + (" (memoised)" if cached else f" Computed in {elapsed:.2f} s."))

st.subheader("Where does this token look?")
q1, q2 = st.columns([3, 1])
query = checked(q1.slider("Query position", 0, T - 1, T - 1, key="att_query"), 0, T - 1, "Query position")
k = checked(q2.slider("Top-k", 1, 32, 10, key="att_topk"), 1, 32, "Top-k")
top, top_fig = memo(figures, (key, "top", layer, head, query, k),
                    lambda: (lambda t: (t, top_attended_figure(t)))(top_attended(m, query, labels, k)), max_entries=8)
st.caption(f"Query {plain(labels[query])} (layer {layer}, {what})")
chart(top_fig, key="att_bars")
table(top, "att_top_table")      # on the projector an HTML table in its type, not the 13-px grid

qk_section(model, ids, labels, layer, head, query, key)

st.subheader("All layers × heads: attention entropy")
st.caption("Mean entropy (nats) of each head's attention rows: low = sharply focused (e.g. on the first token "
           "or the previous one), high = spread out (uniform over n keys: ln n). "
           "Computed in one forward without materialising any pattern; for more than 256 positions from 256 "
           "evenly spaced query rows.")
what = "the attention entropy of every layer and head"
ok = (key in overviews) or T <= OVERVIEW_AUTO or was_stopped(what, key) or st.button("Compute the overview",
                                                                                      key="att_overview_btn")
if ok:
    ent = on_demand(overviews, key, what, lambda tell: entropy_overview(model, ids, on_progress=tell),
                    work=(model, T, cfg.num_layers), max_entries=4)
    if ent is not None:
        chart(memo(figures, (key, "entropy"), lambda: entropy_figure(ent, cfg.layer_window), max_entries=8),
              key="att_entropy")
else:
    st.info(f"{T} positions: one full forward (several seconds on a CPU). Press the button to compute it.")

atlas_section(model, layer, head)
