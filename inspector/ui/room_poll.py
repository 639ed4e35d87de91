"""Polls in a room, above the page: the teacher asks "what comes next?" at the step on screen; each browser
answers once (one of the model's top candidates, or a typed word mapped to its token); the teacher reveals
the class's answers next to the model's distribution at that step under the room's sampling settings
(computed from the run's captured logits: nobody's screen calls the model).

Token texts come from a run (a file, the store) and answers from browsers: they reach the screen as plain
text only (st.text, a table, Markdown-escaped labels, HTML-escaped chart labels), never as Markdown or HTML."""
from __future__ import annotations

import html

import plotly.graph_objects as go
import streamlit as st

from inspector.session.memo import run_key
from inspector.session.rooms import shared_store
from inspector.session.rooms_poll import answer_token, model_probs, poll_table
from inspector.session.rooms_state import MAX_ANSWER_CHARS, ROOM_ERRORS, Poll, RoomState
from inspector.session.state import RoomSeat
from inspector.ui.common import get_model, plain
from inspector.ui.state import session
from inspector.ui.widgets import chart
from inspector.views.sampling import describe

CHOICES = 5                  # the model's top candidates offered as answers


def room_run(r: RoomSeat, run_id: str | None):
    """The run this session keeps that the room showed as run_id (the teacher's own, or a student's copy)."""
    for run in reversed(session().runs):
        if r.role == "teacher" and run_key(run) == r.run_key and r.run_id == run_id:
            return run
        if r.role == "student" and run.extra.get("room_run_id") == run_id:
            return run
    return None


def text_of(run):
    model = get_model()
    tok = model.tokenizer if model is not None and run is not None and model.name == run.model_name else None
    known = {c.id: c.text for s in (run.result.steps if run is not None else []) for c in s.top}

    def text(i: int) -> str:
        if i in known:
            return known[i]
        try:
            return tok.decode([i]) if tok is not None else f"#{i}"
        except Exception:         # an id outside the vocabulary
            return f"#{i}"
    return text, tok


def poll_box(r: RoomSeat, state: RoomState, answers: int | None = None) -> None:
    poll = state.poll
    run = room_run(r, state.run_id if poll is None else poll.run_id)
    if poll is None:
        if r.role == "teacher" and run is not None and run.result.steps:
            _ask(r, state, run)
        return
    text, tok = text_of(run)
    with st.container(border=True):
        st.markdown(f"**What comes next?** Poll {poll.id}, at step {poll.step}")
        if run is not None and poll.step < len(run.result.steps):
            before = "".join(s.text for s in run.result.steps[:poll.step])[-160:]
            st.text(f"…{(run.settings.prompt[-80:] if not before else before)} ▢")
        if r.role == "teacher":
            _teacher_controls(r, poll, answers)
        else:
            _answer(r, poll, text, tok)
        if poll.revealed:
            _reveal(r, state, poll, run, text)


def _ask(r: RoomSeat, state: RoomState, run) -> None:
    if not st.button("Ask the class: what comes next?", key="room_ask",
                     help=f"At the step on screen (the Sampling page's step). Students answer with one of the model's "
                          f"top {CHOICES} candidates or a word of their own."):
        return
    try:
        store = shared_store()
        now = store.state(r.code) or state               # the step on screen now (a fragment may have moved it)
        step = min(now.view.step, len(run.result.steps) - 1)
        top = sorted(c.id for c in run.result.steps[step].top[:CHOICES])   # by id: the order gives nothing away
        store.ask(r.code, r.token, step, top)
    except ROOM_ERRORS as e:
        st.error(plain(e))
        return
    st.rerun()


def _teacher_controls(r: RoomSeat, poll: Poll, answers: int | None) -> None:
    st.caption(f"{'?' if answers is None else answers} answers so far")     # rerun as answers arrive (room_push)
    c1, c2 = st.columns(2)
    if not poll.revealed and c1.button("Reveal the answers", key="room_reveal", type="primary"):
        _call(lambda: shared_store().reveal(r.code, r.token))
    if c2.button("Close the poll", key="room_close_poll"):
        _call(lambda: shared_store().close_poll(r.code, r.token))


def _call(f) -> None:
    try:
        f()
    except ROOM_ERRORS as e:
        st.error(plain(e))
        return
    st.rerun()


def _answer(r: RoomSeat, poll: Poll, text, tok) -> None:
    mine = r.answered.get(poll.id)
    if mine is None:         # this browser may have answered in another tab, or before a reload: its answer counts
        try:
            mine = shared_store().my_answer(r.code, poll.id, r.voter)
        except ROOM_ERRORS:
            mine = None
        if mine is not None:
            r.answered[poll.id] = mine
    if mine is not None:
        st.caption(f"Your answer: {plain(repr(text(mine)))}." + ("" if poll.revealed else " The teacher reveals "
                                                                 "the class's answers next to the model's."))
        return
    if poll.revealed:
        return
    with st.form(f"room_poll_{poll.id}", border=False):
        pick = st.radio("The model's top candidates", [None, *poll.choices], horizontal=True, key="room_pick",
                        format_func=lambda i: "(none)" if i is None else plain(repr(text(i))))   # labels are Markdown
        typed = st.text_input("or type your guess", max_chars=MAX_ANSWER_CHARS, key="room_typed",
                              disabled=tok is None)
        if not st.form_submit_button("Answer", type="primary"):
            return
    try:
        if typed and typed.strip():
            token_id = answer_token(tok.encode, typed, {i: text(i) for i in poll.choices})
        elif pick is not None:
            token_id = pick
        else:
            st.warning("Pick a candidate or type a guess.")
            return
        fresh = shared_store().answer(r.code, poll.id, r.voter, int(token_id))
    except ROOM_ERRORS as e:
        st.error(plain(e))
        return
    if fresh:
        r.answered[poll.id] = int(token_id)
    else:                    # another tab of this browser answered first: its answer is the one shown (above)
        session().room_notice = "This browser had already answered this poll (in another tab); the first answer counts."
    st.rerun()


def _reveal(r: RoomSeat, state: RoomState, poll: Poll, run, text) -> None:
    try:
        tally = shared_store().tally(r.code, poll.id)
    except ROOM_ERRORS as e:
        st.error(plain(e))
        return
    params = state.view.params
    probs = model_probs(run, poll.step, params) if run is not None else None
    table = poll_table(tally, probs, text)
    total = sum(tally.values())
    labels = [html.escape(repr(t), quote=False) for t in table["token"]]     # Plotly draws tags: <a>, <b>…
    fig = go.Figure([go.Bar(name="the class", x=labels, y=table["class_share"]),
                     go.Bar(name="the model", x=labels, y=table["model_prob"])])
    fig.update_layout(barmode="group", yaxis_title="share / probability", xaxis_title="next token",
                      title=f"Poll {poll.id}: {total} answers vs the model at step {poll.step}", height=340)
    chart(fig, key=f"room_poll_fig_{poll.id}")
    counts = ", ".join(f"{text(i)!r} {n}" for i, n in sorted(tally.items(), key=lambda kv: (-kv[1], kv[0])))
    st.text(f"Class answers: {total} in all" + (f": {counts}" if counts else ""))
    st.caption(f"The model: its sampling probabilities at step {poll.step} under "
               f"the room's settings ({describe(params)})" + ("" if probs is not None else " (not available here: "
                                                             "this screen does not hold the poll's run)") + ".")
    st.dataframe(table, hide_index=True, key=f"room_poll_table_{poll.id}",
                 column_config={"class_share": st.column_config.NumberColumn(format="%.2f"),
                                "model_prob": st.column_config.NumberColumn(format="%.4f")})
