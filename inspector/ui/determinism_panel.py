"""The Compare runs page's determinism check (engine.tools.determinism): "thirty students, T = 0 — thirty identical
answers?", checked live. The page's prompt, greedy, run alone a few times, inside one batch of a class (the request
and class - 1 other runs sharing its forwards), on one thread and on the other decode path; each trial compared with
the first bit for bit, the first step and stage where one parts from it shown. Bounded by the tool's own limits and
the server's (check_settings), run in a device slot like the page's comparison."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from engine import EngineError, RunSettings
from engine.tools.determinism import MAX_BATCH, MAX_NEW_TOKENS, MAX_REPEATS, check_determinism
from inspector.session.run import check_settings
from inspector.ui.common import device_slot, greedy
from inspector.ui.state import session
from inspector.ui.widgets import checked



def determinism_section(model, base: RunSettings, limits) -> None:
    """The check's controls, its run on the button, and the last report (base: the page's prompt and seed)."""
    st.subheader("One answer whoever else is running?")
    st.caption("The prompt above, greedy (T = 0), run alone, then inside one batch of a class (its prefill packed "
               "and its decode steps batched with the other students' runs), on one thread, and on the other decode "
               "path. Each run is compared with the first bit for bit: its tokens, every step's logits, every "
               "statistic of every stage.")
    c = st.columns(3)
    size = checked(c[0].number_input("Class size (one batch)", 2, MAX_BATCH, MAX_BATCH, key="det_class"), 2,
                   MAX_BATCH, "Class size")
    repeats = checked(c[1].number_input("Runs alone", 1, MAX_REPEATS, 2, key="det_repeats"), 1, MAX_REPEATS,
                      "Runs alone")
    most = min(MAX_NEW_TOKENS, limits.max_new_tokens)
    tokens = checked(c[2].number_input("New tokens", 1, most, min(16, most), key="det_tokens"), 1, most,
                     "New tokens")
    if st.button("Check determinism", key="det_run"):
        settings = greedy(base, tokens)
        try:
            check_settings(model, settings, limits)           # the server's own bounds, as a Run's
            bar = st.progress(0.0, text="Waiting for the model…")
            with device_slot("the determinism check"):
                rep = check_determinism(model, settings, repeats=repeats, batches=(size,),
                                        on_progress=lambda p: bar.progress(min(1.0, p.fraction), text=p.what))
        except EngineError as e:
            st.error(str(e))
            return
        bar.empty()
        session().determinism = rep.as_dict()
    d = session().determinism
    if d is None:
        st.info("Press **Check determinism** to run it.")
        return
    same = d["distinct_outputs"] == 1
    (st.success if same else st.warning)(f"**{d['headline']}.** Reference: {d['reference']}.")
    st.dataframe(trials_table(d), hide_index=True, key="det_table")
    for note in d["skipped"]:
        st.caption(f"Not tried: {note}")


def trials_table(d: dict) -> pd.DataFrame:
    rows = []
    for t in d["trials"]:
        s = t["first_stage"]
        rows.append({"run": t["label"], "differs from the first in": t["why"], "same tokens": t["same_tokens"],
                     "bit-identical": t["bit_identical"], "logits differ from step": t["first_step"],
                     "by (max abs)": t["logits_max_abs"] if t["first_step"] is not None else None,
                     "first statistic that differs": None if s is None else
                     f"step {s['step']}, {s['stage']}, position {s['position']}",
                     "notes": "; ".join(t["notes"])})
    return pd.DataFrame(rows)
