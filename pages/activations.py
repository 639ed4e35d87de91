"""Activations: per-layer statistics of every stage (recorded during the run), a position × layer heatmap,
NaN/Inf cells, and the logit lens (one forward per chosen position, memoised)."""

import streamlit as st

from inspector.session.memo import memo, run_key
from inspector.ui.common import get_model, on_demand, plain, require_run, was_stopped
from inspector.ui.frame import ensure_frame
from inspector.ui.lens_panel import tuned_lens_section
from inspector.ui.state import session
from inspector.ui.widgets import chart, checked
from inspector.views import experts as ex
from inspector.views.activations import (
    MAX_POSITIONS,
    STATS,
    layer_stages,
    layer_summary,
    lines_figure,
    logit_lens,
    logit_lens_figure,
    nonfinite_cells,
    position_layer,
    position_layer_figure,
    position_window,
    stage_table,
)
from inspector.views.tokens import token_labels

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

LENS_K = 10
LENS_AUTO = 512      # positions from here on compute the lens only when asked (a forward over them all)


st.header("Activations")
run = require_run()
blocks, key = run.recording.stats, run_key(run)
cache = session().memo("act_cache")
summary = memo(cache, (key, "summary"), lambda: layer_summary(blocks), max_entries=16)
stages = layer_stages(blocks)
if not stages:
    st.info("This run recorded no per-layer statistics.")
    st.stop()
num_layers = int(summary["layer"].max()) + 1

st.subheader("Per-layer statistics")
st.caption("Pooled over every position of every step. RMS = √(mean² + std²).")
default = [s for s in ("resid_post", "attn_out", "mlp_out") if s in stages] or stages[:1]
c1, c2, c3 = st.columns([3, 1, 1])
chosen = c1.multiselect("Stages", stages, default, key="act_stages")
stat = c2.selectbox("Statistic", STATS, index=STATS.index("rms"), key="act_stat")
log_y = c3.toggle("Log scale", False, key="act_log")
table = stage_table(summary, chosen)
if chosen:
    chart(lines_figure(table, stat, log_y=log_y), key="act_lines")
st.dataframe(table, key="act_table", hide_index=True)
with st.expander("Stages outside the layers (embed, final_norm, logits, sampler)"):
    st.dataframe(summary[summary["layer"].isna()], key="act_other", hide_index=True)

st.subheader("Position × layer")
h1, h2 = st.columns(2)
heat_stage = h1.selectbox("Stage", stages, index=stages.index(default[0]), key="act_heat_stage")
heat_stat = h2.selectbox("Statistic", STATS, index=STATS.index("rms"), key="act_heat_stat")
matrix = memo(cache, (key, "heat", heat_stage, heat_stat),
              lambda: position_layer(blocks, heat_stage, heat_stat, num_layers), max_entries=16)
bad = memo(cache, (key, "nonfinite"), lambda: nonfinite_cells(blocks), max_entries=16)
model = get_model()
same_model = model is not None and model.name == run.model_name
labels = token_labels(model.tokenizer, run.ids) if same_model else [str(i) for i in range(len(run.ids))]
heat_bad = bad[bad["stage"] == heat_stage]
start = 0
if len(matrix) > MAX_POSITIONS:
    label = f"Positions from ({MAX_POSITIONS} shown; default: around the first NaN/Inf, else the last)"
    start = checked(st.slider(label, 0, len(matrix) - MAX_POSITIONS, position_window(matrix.index, heat_bad),
                              key="act_heat_from"), 0, len(matrix) - MAX_POSITIONS, "Positions from")
skip_first = st.toggle("Leave position 0 out of the colour scale", True, key="act_heat_skip0",
                       help="The first token carries activations many times larger than any other (the "
                            "attention sink's massive activations); counted in, they wash every other cell out.")
chart(position_layer_figure(matrix, labels, heat_stat, heat_bad, start=start, skip_first=skip_first),
      key="act_heat")
st.caption("Step 0 (the prefill) gives the prompt positions; each later step one position. Colours span a robust "
           "range of the cells (extremes take the end colours). A red ✕ marks a cell holding NaN or Inf.")

st.subheader("NaN / Inf")
if len(bad):
    st.error(f"{len(bad)} (step, position, stage) cells hold NaN or Inf; the first is "
             f"{bad.iloc[0]['name']} at position {bad.iloc[0]['position']}.")
    st.dataframe(bad, key="act_nonfinite", hide_index=True)
else:
    st.success("Every stage stayed finite at every position.")

if same_model and ex.moe_layers(model.config):
    mcfg, T = model.config, len(run.ids)
    st.subheader("Mixture of experts: routing")
    st.caption(f"{len(ex.moe_layers(mcfg))} of {mcfg.num_layers} layers are experts layers: a router scores each "
               f"token against {mcfg.num_experts} experts and sends it to its top {mcfg.experts_per_token}, whose "
               "outputs are summed weighted by their gates (blocks.{i}.mlp.router, blocks.{i}.mlp.experts). "
               "Computed by one forward over the run's tokens.")
    what = f"the expert routing over {T:,} positions"
    if ((key, "experts") in cache or T <= LENS_AUTO or was_stopped(what, (key, "experts"))
            or st.button("Compute the routing", key="act_moe_btn")):
        routing = on_demand(cache, (key, "experts"), what,
                            lambda tell: ex.expert_routing(model, run.ids, on_progress=tell),
                            work=(model, T, mcfg.num_layers), max_entries=16)
        if routing is not None:
            load = memo(cache, (key, "experts_load"), lambda: ex.expert_load(routing), max_entries=16)
            st.markdown("**Load per expert over the run** (tokens routed to each; a balanced router gives every "
                        f"cell about {T * mcfg.experts_per_token / mcfg.num_experts:.1f})")
            chart(ex.load_figure(load), key="act_moe_load")
            e1, e2 = st.columns(2)
            moe_layer = e1.selectbox("Experts layer", list(routing.layers), key="act_moe_layer",
                                     format_func=lambda i: f"Layer {i}")
            shown = e2.radio("Show", ["gates", "probs"], horizontal=True, key="act_moe_what",
                             format_func=lambda w: {"gates": "gate weights (top-k, 0 elsewhere)",
                                                    "probs": "router probabilities (all experts)"}[w])
            m0 = 0
            if T > MAX_POSITIONS:
                m0 = checked(st.slider("Positions from", 0, T - MAX_POSITIONS, T - MAX_POSITIONS, key="act_moe_from"),
                             0, T - MAX_POSITIONS, "Positions from")
            m = ex.layer_matrix(routing, moe_layer, shown)[m0:m0 + MAX_POSITIONS]
            chart(ex.routing_figure(m, labels, f"Layer {moe_layer}: {shown}", m0), key="act_moe_map")
            st.markdown("**Top expert of each token at each experts layer**")
            chart(ex.top_expert_figure(routing, labels, m0, MAX_POSITIONS), key="act_moe_top")
            with st.expander(f"Layer {moe_layer}: each token's experts, gates and router probabilities"):
                st.dataframe(ex.routing_table(routing, labels, [moe_layer]), key="act_moe_table", hide_index=True)
            with st.expander("Load table"):
                st.dataframe(load, key="act_moe_load_table", hide_index=True)
    else:
        st.info(f"{T} positions: one forward over them all. Press the button to compute the routing.")

st.subheader("Logit lens")
if not same_model:
    st.warning(f"This run was made with **{plain(run.model_name)}**; choose that model in the sidebar for the "
               "logit lens.")
    st.stop()
ids = run.ids
l1, l2 = st.columns([3, 1])
pos = checked(l1.slider("Position", 0, len(ids) - 1, run.n_prompt - 1, key="act_lens_pos"), 0, len(ids) - 1,
              "Position")
k = checked(l2.slider("Top-k", 1, LENS_K, 5, key="act_lens_k"), 1, LENS_K, "Top-k")
nxt = f"the actual next token is {plain(repr(labels[pos + 1]))}" if pos + 1 < len(ids) else "the run ends here"
st.caption(f"What each layer's residual stream at {plain(repr(labels[pos]))} predicts next (through the final norm and "
           f"the unembedding); {nxt}. The last layer's row is the model's own prediction.")
what = f"the logit lens over {pos + 1:,} positions"
if ((key, "lens", pos) in cache or pos < LENS_AUTO or was_stopped(what, (key, "lens", pos))
        or st.button("Compute the logit lens", key="act_lens_btn")):
    lens = on_demand(cache, (key, "lens", pos), what,
                     lambda tell: logit_lens(model, ids, pos, LENS_K, on_progress=tell),
                     work=(model, pos + 1, model.config.num_layers), max_entries=16)
    if lens is not None:
        chart(logit_lens_figure(lens, k), key="act_lens")
        st.dataframe(lens[lens["rank"] < k], key="act_lens_table", hide_index=True)
else:
    st.info(f"Position {pos}: one forward over {pos + 1} positions (seconds on a CPU). Press the button.")
tuned_lens_section(model, key, ids, pos, k, LENS_K, pos < LENS_AUTO)
