"""The Compare runs page's steering section (engine.tools.steering): a vector from two contrasting prompt sets (the
mean difference of their residual streams after a layer), added with a coefficient while the page's prompt is
continued, the plain and the steered continuations side by side, and how far each steered step's distribution moved
from the plain model's on the same prefix. Bounded by the tool's limits and the server's (check_settings); run in a
device slot like the page's comparison.

In a room (inspector.ui.room), the teacher can show the vector and its run to the class (RoomStore.publish_steering):
every student's screen draws the teacher's plain and steered continuations as published, and a student can add the
same vector, bit for bit, to this page's prompt with a coefficient of their own (their own run, in their own device
slot)."""
from __future__ import annotations

import pandas as pd
import streamlit as st

import torch

from engine import EngineError, RunSettings
from engine.tools.steering import MAX_COEFFICIENT, MAX_PROMPTS, SteeringVector, steer, steering_vector
from inspector.session.rooms import shared_store
from inspector.session.rooms_state import ROOM_ERRORS
from inspector.session.rooms_steer import RoomSteering
from inspector.session.run import check_settings
from inspector.ui.common import device_slot, greedy, plain
from inspector.ui.room_sync import room
from inspector.ui.state import session
from inspector.ui.widgets import checked, checked_float, checked_text

MAX_SET_CHARS = 4_000          # one side's prompts, one a line
POSITIVE = "I love this. It is wonderful and I am so happy.\nWhat a great, joyful day!"
NEGATIVE = "I hate this. It is awful and I am so sad.\nWhat a terrible, miserable day!"


def steering_section(model, base: RunSettings, limits) -> None:
    r = room()
    if r is not None and r.role == "student":
        room_steering(model, base, limits, r)
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
    coefficient, tokens = run_inputs(c[1], c[2], limits, "Coefficient", 4.0, "steer")
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
        session().steered = {**run.as_dict(), "norm": vec.norm, "stage": vec.stage, "vector": vec.vector.tolist(),
                             "positive": list(vec.positive), "negative": list(vec.negative),
                             "prompt": settings.prompt, "model": model.name}
    d = session().steered
    if d is None:
        st.info("Press **Steer** to run it.")
        return
    draw(d)
    if r is not None and r.role == "teacher" and "vector" in d:
        publish_button(r, d)


def publish_button(r, d: dict) -> None:
    """The teacher's "show it to the room": the vector and this run, as the room's steering document."""
    if st.button("Show this steering to the room", key="steer_publish",
                 help="Students see these two continuations, and can add the same vector to their own prompt"):
        try:
            doc = RoomSteering.of_run(d["model"], d["vector"], d["positive"], d["negative"], d["prompt"], d)
            shared_store().publish_steering(r.code, r.token, doc)
        except ROOM_ERRORS as e:
            st.error(f"Could not show the steering to the room: {e}")
            return
        st.success(f"The room shows this steering ({d['stage']}, coefficient {d['coefficient']:g}).")


def room_steering(model, base: RunSettings, limits, r) -> None:
    """A student's view of the steering the teacher showed the room (nothing when none was), and the same vector
    added to this page's prompt with the student's own coefficient."""
    state = r.state
    if state is None or state.steer_id is None:
        return
    try:
        doc = shared_store().steering(r.code, state)
    except ROOM_ERRORS as e:
        st.warning(f"The room's steering could not be read: {e}")
        return
    if doc is None:
        return
    st.markdown(f"**The teacher's steering** ({doc.stage}, from {len(doc.positive)} positive and "
                f"{len(doc.negative)} negative prompts), on the prompt {plain(doc.prompt[:200])!r}:")
    draw(doc.as_run())
    if doc.model != model.name or len(doc.vector) != model.config.hidden_size \
            or doc.layer >= model.config.num_layers:
        st.info(f"The room's vector was made on **{plain(doc.model)}**; choose that model to add it to your prompt.")
        return
    c = st.columns(2)
    coefficient, tokens = run_inputs(c[0], c[1], limits, "Your coefficient", float(doc.coefficient), "steer_room")
    if st.button("Add the room's vector to my prompt", key="steer_room_run"):
        settings = greedy(base, tokens)
        vec = SteeringVector(doc.layer, torch.tensor(doc.vector, dtype=torch.float32), doc.positive, doc.negative)
        try:
            check_settings(model, settings, limits)
            with device_slot("steering"), st.spinner("Steering…"):
                run = steer(model, settings, vec, coefficient)
        except EngineError as e:
            st.error(str(e))
            return
        session().steered = {**run.as_dict(), "norm": vec.norm, "stage": vec.stage}
    st.divider()


def run_inputs(left, right, limits, label: str, default: float, prefix: str) -> tuple[float, int]:
    """The coefficient and the number of new tokens (keys prefix_coef, prefix_tokens), checked on the server."""
    coefficient = checked_float(left.number_input(label, -100.0, 100.0, default, step=0.5, key=f"{prefix}_coef"),
                                -MAX_COEFFICIENT, MAX_COEFFICIENT, label)
    most = min(64, limits.max_new_tokens)
    tokens = checked(right.number_input("New tokens", 1, most, min(16, most), key=f"{prefix}_tokens"), 1, most,
                     "New tokens")
    return coefficient, tokens


def draw(d: dict) -> None:
    """The plain and steered continuations side by side, and the per-step table."""
    st.caption(f"{d['stage']}, coefficient {d['coefficient']:g}, vector norm {d['norm']:.3g}")
    left, right = st.columns(2)
    left.markdown("**Plain**")
    left.code(d["plain_text"] or "(nothing)", language=None, wrap_lines=True)
    right.markdown("**Steered**")
    right.code(d["steered_text"] or "(nothing)", language=None, wrap_lines=True)
    st.dataframe(steps_table(d), hide_index=True,
                 column_config={c: st.column_config.NumberColumn(format="%.4f")
                                for c in ("KL(steered || plain)", "p steered", "p plain")})


def steps_table(d: dict) -> pd.DataFrame:
    return pd.DataFrame([{"step": s["step"], "steered token": repr(s["text"]),     # a table shows text as it is
                          "KL(steered || plain)": s["kl_steered_plain"], "p steered": s["p_steered"],
                          "p plain": s["p_plain"], "plain's top": repr(s["plain_top_text"])}
                         for s in d["steps"]])
