"""The Compare runs page's steering section (engine.tools.steering): a vector from two contrasting prompt sets (the
mean difference of their residual streams after a layer), added with a coefficient while the page's prompt is
continued, the plain and the steered continuations side by side, and how far each steered step's distribution moved
from the plain model's on the same prefix. Bounded by the tool's limits and the server's (check_settings); run in a
device slot like the page's comparison."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from engine import EngineError, RunSettings
from engine.tools.steering import MAX_COEFFICIENT, MAX_PROMPTS, steer, steering_vector
from inspector.session.run import check_settings
from inspector.ui.common import device_slot, greedy
from inspector.ui.state import session
from inspector.ui.widgets import checked, checked_float, checked_text

MAX_SET_CHARS = 4_000          # one side's prompts, one a line
POSITIVE = "I love this. It is wonderful and I am so happy.\nWhat a great, joyful day!"
NEGATIVE = "I hate this. It is awful and I am so sad.\nWhat a terrible, miserable day!"


def steering_section(model, base: RunSettings, limits) -> None:
    st.caption("The vector: each positive prompt's mean residual stream after the layer, averaged, less the same "
               "over the negative prompts. It is added, times the coefficient, to that layer's output at every "
               "position while the prompt above is continued greedily; the plain run beside it computes the same "
               "way without it (coefficient 0: the two are one run, bit for bit).")
    c = st.columns(2)
    pos = checked_text(c[0].text_area("Positive prompts (one a line)", POSITIVE, key="steer_pos",
                                      max_chars=MAX_SET_CHARS), MAX_SET_CHARS, "Positive prompts")
    neg = checked_text(c[1].text_area("Negative prompts (one a line)", NEGATIVE, key="steer_neg",
                                      max_chars=MAX_SET_CHARS), MAX_SET_CHARS, "Negative prompts")
    c = st.columns(3)
    last = model.config.num_layers - 1
    layer = checked(c[0].number_input("Layer", 0, last, min(last, model.config.num_layers * 2 // 5),
                                      key="steer_layer"), 0, last, "Layer")
    coefficient = checked_float(c[1].number_input("Coefficient", -100.0, 100.0, 4.0, step=0.5, key="steer_coef"),
                                -MAX_COEFFICIENT, MAX_COEFFICIENT, "Coefficient")
    most = min(64, limits.max_new_tokens)
    tokens = checked(c[2].number_input("New tokens", 1, most, min(16, most), key="steer_tokens"), 1, most,
                     "New tokens")
    if st.button("Steer", key="steer_run"):
        settings = greedy(base, tokens)
        lines = [[x for x in text.splitlines() if x.strip()] for text in (pos, neg)]
        try:
            check_settings(model, settings, limits)
            if any(len(x) > MAX_PROMPTS for x in lines):
                raise EngineError(f"each set holds at most {MAX_PROMPTS} prompts")
            with device_slot("steering"), st.spinner("Steering…"):
                vec = steering_vector(model, lines[0], lines[1], layer, chat=bool(base.chat))
                run = steer(model, settings, vec, coefficient)
        except EngineError as e:
            st.error(str(e))
            return
        session().steered = {**run.as_dict(), "norm": vec.norm, "stage": vec.stage}
    d = session().steered
    if d is None:
        st.info("Press **Steer** to run it.")
        return
    st.caption(f"{d['stage']}, coefficient {d['coefficient']:g}, vector norm {d['norm']:.3g}")
    left, right = st.columns(2)
    left.markdown("**Plain**")
    left.code(d["plain_text"] or "(nothing)", language=None, wrap_lines=True)
    right.markdown("**Steered**")
    right.code(d["steered_text"] or "(nothing)", language=None, wrap_lines=True)
    st.dataframe(steps_table(d), hide_index=True, key="steer_table",
                 column_config={c: st.column_config.NumberColumn(format="%.4f")
                                for c in ("KL(steered || plain)", "p steered", "p plain")})


def steps_table(d: dict) -> pd.DataFrame:
    return pd.DataFrame([{"step": s["step"], "steered token": repr(s["text"]),     # a table shows text as it is
                          "KL(steered || plain)": s["kl_steered_plain"], "p steered": s["p_steered"],
                          "p plain": s["p_plain"], "plain's top": repr(s["plain_top_text"])}
                         for s in d["steps"]])
