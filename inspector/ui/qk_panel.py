"""The Attention page's "Why does it look there?": one head's score from the chosen query to a key split into
query-side x key-side components (engine.tools.qk_attribution), on the button, memoised per run in this session."""
from __future__ import annotations

import streamlit as st

from engine import EngineError
from engine.tools.qk_attribution import MAX_POSITIONS, qk_attribution
from inspector.ui.common import device_slot, plain
from inspector.ui.state import session
from inspector.ui.widgets import chart, checked, table
from inspector.views.qk import groups_figure, pairs_table



def qk_section(model, ids: list[int], labels: list[str], layer: int, head: int | None, query: int,
               run_key) -> None:
    st.subheader("Why does it look there?")
    if head is None:
        st.info("Choose one head above (not the average) to split its score into the parts of the stream.")
        return
    if len(ids) > MAX_POSITIONS:
        st.info(f"This run has {len(ids):,} positions; the split takes at most {MAX_POSITIONS:,}.")
        return
    st.caption("The score (before softmax) of this head from the query to one key is scale · q · k, and with the "
               "attention norm's scale frozen at each of the two positions, q and k are sums over the parts of "
               "the residual stream entering the layer: the embedding, every earlier head, every earlier MLP. "
               "Each cell is one (query-side part, key-side part) pair's share; the cells sum to the score. "
               "Through a LayerNorm each part is centred first; the norm's bias and the projection's bias are "
               "constants of each side, paired with every part of the other.")
    key = checked(st.number_input("Key position", 0, query, min(query, max(0, query - 1)), key="qk_key"), 0, query,
                  "Key position")
    want = (run_key, layer, head, query, key)
    if st.button("Split the score", key="qk_run"):
        try:
            with device_slot("the score's split"), st.spinner("One forward, then the split…"):
                session().qk = (want, qk_attribution(model, ids, layer, head, query, key).as_dict(25))
        except EngineError as e:
            st.error(str(e))
            return
    got = session().qk
    if got is None or got[0] != want:
        st.info(f"Press **Split the score** for head {head}, query {plain(labels[query])} → key "
                f"{plain(labels[key])}.")
        return
    d = got[1]
    exact = "exact" if d["exact"] else f"not exact ({d['why_inexact']})"
    st.caption(f"Score {d['score']:.5g}; the terms sum to {d['total']:.5g} (remainder {d['remainder']:.2g}: "
               f"{exact}).")
    chart(groups_figure(d), key="qk_map")
    table(pairs_table(d), "qk_pairs", formats={"term": "%.4f"})
