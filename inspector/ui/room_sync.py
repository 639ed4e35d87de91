"""What a room shares between a teacher's screen and the students' screens: the selection widgets (the step,
layer and head, the sampling settings of the Sampling page's first column) and this session's place in a
room. The teacher's changes are published from the widgets' callbacks (so a change inside a fragment, which
does not rerun app.py, still reaches the room) and after every full script run; a following student's
widgets take the room's values and are disabled (inspector.ui.widgets.shared).

This session's place in a room is its SessionState's room seat (inspector.session.state.RoomSeat: a teacher's
code, publish token, page and view; a student's code, following flag, version, voter and answers).
"""
from __future__ import annotations

from dataclasses import fields

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from engine import SamplingParams
from inspector.session.rooms import shared_store, voter_of
from inspector.session.rooms_state import ROOM_ERRORS, RoomError, View
from inspector.session.state import RoomSeat
from inspector.ui.state import session

STEP, LAYER, HEAD = "smp_step", "att_layer", "att_head"
PARAMS_PREFIX = "smp_0"          # the Sampling page's first column ("the run's settings")
_PARAM_TYPES = {f.name: (int if f.type in ("int", int) else float) for f in fields(SamplingParams)}
PARAM_KEYS = {f"{PARAMS_PREFIX}_{name}": name for name in _PARAM_TYPES}
SHARED_KEYS = frozenset({STEP, LAYER, HEAD, *PARAM_KEYS})


def room() -> RoomSeat | None:
    return session().room


def is_teacher() -> bool:
    r = room()
    return r is not None and r.role == "teacher"


def following() -> bool:
    r = room()
    return r is not None and r.role == "student" and r.following


def session_id() -> str:
    """This script run's session (what the room's watcher reruns)."""
    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else "no-session"


def voter_id(code: str) -> str:
    """The name this browser's answers in room `code` are kept under: every tab of one browser shares it (one
    answer per browser and poll, inspector.ui.common.client_key), never the browser's token itself."""
    from inspector.ui.common import client_key  # inspector.ui.common imports the frame, which the widgets need first
    return voter_of(code, client_key() or ("session:" + session_id()))


# ---- the student's side: the room's values for the widgets --------------------------------------------------
def widget_values(view: View, n_steps: int | None) -> dict:
    """Session-state values for the shared widgets; a step beyond the run is clamped to its last step."""
    step = view.step if n_steps is None else min(view.step, max(0, n_steps - 1))
    values = {STEP: step, LAYER: view.layer, HEAD: view.head}
    for key, name in PARAM_KEYS.items():
        values[key] = _PARAM_TYPES[name](getattr(view.params, name))
    return values


# ---- the teacher's side: publishing ------------------------------------------------------------------------
def teacher_view(prev: View, page: str | None) -> View:
    """The view on the teacher's screen: this script run's values of the shared widgets, the last published
    ones for widgets not on this page."""
    s = st.session_state
    params = {name: s[key] for key, name in PARAM_KEYS.items() if key in s}
    try:
        p = SamplingParams(**{**{f.name: getattr(prev.params, f.name) for f in fields(SamplingParams)},
                              **{k: _PARAM_TYPES[k](v) for k, v in params.items()}})
    except (TypeError, ValueError):
        p = prev.params
    head = s[HEAD] if HEAD in s else prev.head
    return View(page=page or prev.page, step=int(s.get(STEP, prev.step)), layer=int(s.get(LAYER, prev.layer)),
                head=None if head is None else int(head), params=p)


def publish_view(page: str | None = None) -> None:
    """Publish the teacher's view if it changed (a widget callback, and after every full script run)."""
    r = room()
    if r is None or r.role != "teacher":
        return
    if page is not None:
        r.page = page
    prev = r.view or View()
    try:
        view = teacher_view(prev, r.page)
    except (RoomError, TypeError, ValueError):
        return
    if view == prev and r.published:
        return
    try:
        shared_store().publish(r.code, r.token, view=view)
        r.view, r.published, r.error = view, True, None
    except ROOM_ERRORS as e:
        r.error = str(e)
