"""The Attention page's head atlas: every head of the model scored on the classic patterns (engine.tools.head_atlas)
over the project's own docs and repeated random tokens, on the button; memoised per model in this session (it
depends on the model, not on the run)."""
from __future__ import annotations

import streamlit as st

from engine.tools.head_atlas import CORPUS_TOKENS, SCORE_NAMES, head_atlas
from inspector.ui.common import on_demand, was_stopped
from inspector.ui.state import session
from inspector.ui.widgets import chart, table
from inspector.views.head_atlas import atlas_figure, atlas_table


def atlas_section(model) -> None:
    st.subheader("Head atlas: what kind of head is each one?")
    st.caption("Every head scored, TransformerLens-style: previous-token (attention from a position to the one "
               "before it), first-token (to position 0, the sink), self (to itself), duplicate-token (to earlier "
               "copies of its own token) and entropy (nats) over prose paragraphs of this project's docs; "
               "induction over random tokens repeated twice (from the second copy, attention to the token after "
               "the earlier copy). Computed for the model, not the run: one forward per text.")
    store, key = session().memo("att_atlas"), (model.name, str(model.dtype), model.device.type)
    what = "the head atlas"
    if not (key in store or was_stopped(what, key) or st.button("Compute the head atlas", key="att_atlas_btn")):
        st.info("About ten forwards of a few hundred tokens: press the button to score every head.")
        return
    atlas = on_demand(store, key, what, lambda tell: head_atlas(model, on_progress=tell),
                      work=(model, CORPUS_TOKENS, model.config.num_layers), max_entries=2)
    if atlas is None:
        return
    df = atlas_table(atlas)
    c1, c2 = st.columns(2)
    x = c1.selectbox("x", SCORE_NAMES, index=0, key="att_atlas_x")
    y = c2.selectbox("y", SCORE_NAMES, index=SCORE_NAMES.index("induction"), key="att_atlas_y")
    chart(atlas_figure(df, x, y), key="att_atlas_map")
    st.caption(f"{atlas.layers} layers × {atlas.heads} heads over {len(atlas.texts)} texts ({atlas.tokens:,} "
               f"tokens) and {atlas.repeats} × 2 × {atlas.length} repeated random tokens (seed {atlas.seed}).")
    sort = st.selectbox("Sort the table by", SCORE_NAMES, index=SCORE_NAMES.index("induction"),
                        key="att_atlas_sort")
    table(df.sort_values(sort, ascending=sort == "entropy"), "att_atlas_table",
          formats={n: "%.3f" for n in SCORE_NAMES}, texts=("top text (previous-token)",))
