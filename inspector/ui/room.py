"""Rooms in the app: a teacher starts one (after entering $LLM_INSPECTOR_TEACHER_KEY once per session) and gets
a code and a link; students who open `/?room=CODE` follow the teacher's run, page, step, layer, head and
sampling settings, read-only, until they choose to explore on their own (their own copy of the run), and
can follow again. Joining: inspector.ui.room_join. Polls: inspector.ui.room_poll.

app.py calls, in order: `before_page(page)` (a student follows: loads a new run, takes the room's values,
switches to the teacher's page; a teacher publishes the page at once), `sidebar_panel()` (start, join, leave,
end), `bar()` inside the frame (the room's line above the page, the watcher, the poll), and
`after_page(page)` (a teacher publishes the run and the view the page ended with).

A student's screen learns of a change without polling in the browser: one watcher thread per process reads
each followed room's state document (a version number) and reruns the sessions that are behind
(inspector.ui.room_push); only a new run id fetches the run's trace bytes. Students never call the model to follow.
"""
from __future__ import annotations

from dataclasses import replace
from urllib.parse import urlsplit

import streamlit as st

from engine.inspection.trace import from_bytes, to_bytes
from inspector.session.limits import trace_bounds
from inspector.session.memo import run_key
from inspector.session.room_runs import ROOM_RUNS
from inspector.session.rooms import shared_store
from inspector.session.rooms_keys import teacher_key_state, teacher_login, warn_short_key
from inspector.session.rooms_state import ROOM_ERRORS, RoomError, View, check_code
from inspector.session.run import track
from inspector.session.state import RoomSeat
from inspector.ui.common import client_key, current_run, get_model, plain, server_limits
from inspector.ui.room_join import from_link, join_form
from inspector.ui.room_live import draw as draw_live
from inspector.ui.room_live import panel as live_panel
from inspector.ui.room_outage import LOST, offline, restore, teacher_offline
from inspector.ui.room_poll import poll_box
from inspector.ui.room_push import FALLBACK_EVERY_S, OFFLINE, signature, watcher
from inspector.ui.room_push import available as push_available
from inspector.ui.room_sync import following, publish_view, room, session_id, widget_values
from inspector.ui.sidebar import keep_run
from inspector.ui.state import session
from inspector.ui.widgets import page_path, pages


def _store():
    return shared_store()


def page_titles() -> dict[str, str]:
    return {p["script_path"].rsplit("/", 1)[-1].removesuffix(".py"): p.get("page_name", "")
            for p in pages() if p.get("script_path")}


def _load_run(code: str, run_id: str):
    """The room's run from its trace bytes, validated against this server's limits and model, parsed once per
    process (inspector.session.room_runs); RoomError when it is no longer in the store."""
    limits, model = server_limits(show_error=False), get_model()
    bounds = trace_bounds(limits, model)

    def load():
        data = _store().run_bytes(code, run_id)
        if data is None:
            raise RoomError("the teacher's run is no longer in the room")
        trace = track(from_bytes(data, bounds))
        trace.extra["room_run_id"] = run_id          # which of this session's runs is the room's (polls)
        return trace
    trace = ROOM_RUNS.get((run_id, repr(bounds)), load)     # one parsed copy per process, shared by the followers
    keep_run(trace, limits.max_runs_kept)
    return trace


# ---- every script run --------------------------------------------------------------------------------------
def before_page(page: str) -> None:
    """Before the sidebar and the page: a following student takes the room's run and values (and page); a
    teacher publishes the page just opened."""
    if room() is None:
        from_link()
    r = room()
    if r is None or r.role == "teacher":
        if r is not None:
            r.widgets = None
            publish_view(page)
        return
    if not r.following:
        r.widgets = None
        return
    state = None
    try:
        state = _store().state(r.code)
        if state is None and _store().was_ended(r.code):
            r.following, r.ended, r.widgets = False, True, None
            return
        if state is None:      # the store restarted without it: the teacher's screen re-opens it (bar)
            r.error, r.seen = LOST, None
            if push_available():
                watcher.watch(session_id(), "follow", r.code, None)
            return
        if state.run_id and state.run_id != r.run_id:
            try:
                _load_run(r.code, state.run_id)
            except Exception:
                r.run_id = state.run_id          # tried once per run id: a bad run is not fetched again
                raise
            r.run_id = state.run_id              # (a script run stopped mid-load by a newer rerun tries again)
        r.live = _store().live_seq(r.code)
        r.error = None
    except ROOM_ERRORS as e:   # the store does not answer: the watcher reruns this screen when it does
        if state is None:
            r.error, r.seen = offline(e), OFFLINE
            if push_available():     # (a screen that joined just now is not watched yet)
                watcher.watch(session_id(), "follow", r.code, OFFLINE)
            return
        r.error = f"Could not follow the room: {e}"
    except Exception as e:     # a run that fails validation: one message, the app goes on
        r.error = f"Could not follow the room: {e}"
        if state is None:
            return
    run = current_run()
    r.widgets = widget_values(state.view, len(run.result.steps) if run is not None else None)
    r.version, r.state, r.seen = state.version, state, signature("follow", state, live=r.live)
    if push_available():
        watcher.watch(session_id(), "follow", r.code, r.seen)
    if state.view.page != page and (path := page_path(state.view.page)) is not None:
        st.switch_page(path, query_params={**st.query_params.to_dict(), "room": r.code})


def after_page(page: str) -> None:
    """After the page: a teacher's new current run is published (its trace bytes), then the view."""
    r = room()
    if r is None or r.role != "teacher":
        return
    run = current_run()
    if run is not None and run_key(run) != r.run_key:
        try:
            state = _store().publish(r.code, r.token, run=to_bytes(run))
            view = r.view or View()
            n = len(run.result.steps)
            r.run_key, r.run_id, r.published, r.error = run_key(run), state.run_id, False, None
            r.view = replace(view, params=run.result.params, step=min(view.step, max(0, n - 1)))
        except ROOM_ERRORS as e:
            r.error = str(e)
    publish_view(page)


# ---- the sidebar: start, join, leave, end -------------------------------------------------------------------
def sidebar_panel() -> None:
    r = room()
    with st.sidebar.expander("Classroom: rooms and polls", expanded=r is not None or bool(session().join_error)):
        ss = session()
        notice, ss.room_notice = ss.room_notice, None
        if notice:
            st.warning(plain(notice))
        if r is not None and r.role == "teacher":
            st.markdown(f"You are teaching room **{plain(r.code)}**.")
            if st.button("End the room", key="room_end", help="Students stop following; its polls are deleted"):
                _end(r)
            return
        if r is not None:
            st.markdown(f"You are in room **{plain(r.code)}**.")
            if st.button("Leave the room", key="room_leave"):
                watcher.drop(session_id())
                ss.room = None
                st.rerun()
            return
        join_form()
        _teacher_form()


def _teacher_form() -> None:
    off = teacher_key_state()
    if off:
        warn_short_key()                    # the suggested key goes to the server's console, never to a browser
        st.caption(plain(off + " Students can still join a room another server of this app started."))
        return
    if not session().teacher_ok:
        key = st.text_input("Teacher key", type="password", key="room_key", max_chars=1024,
                            help="Asked once per browser session; only teachers have it")
        if st.button("I am the teacher", key="room_key_btn", disabled=not key):
            refused = teacher_login(key, client_key() or "anonymous")
            if refused is None:
                session().teacher_ok = True
                st.session_state.pop("room_key", None)
                st.rerun()
            else:
                st.error(refused)
        return
    if st.button("Start a room", key="room_start", type="primary"):
        try:
            code, token = _store().create()
        except ROOM_ERRORS as e:
            st.error(plain(e))
            return
        _become_teacher(code, token)
    again = st.text_input("Or take over a room you started (its code)", key="room_takeover_code", max_chars=12)
    if st.button("Take over", key="room_takeover", disabled=not again):
        try:
            code = check_code(again)
            token = _store().take_over(code)
        except ROOM_ERRORS as e:
            st.error(plain(e))
            return
        _become_teacher(code, token)


def _become_teacher(code: str, token: str) -> None:
    """This session teaches room `code` (its publish token stays on the server), from the next script run."""
    session().room = RoomSeat.teacher(code, token)
    st.rerun()


def _end(r: RoomSeat) -> None:
    """End the room; the teacher's screen leaves it whatever the store says (gone after a Redis restart, taken
    over, unreachable), so no session stays stuck teaching a room that cannot end."""
    try:
        note = _store().end_or_leave(r.code, r.token)
    except ROOM_ERRORS as e:          # the store could not even be chosen (a malformed setting)
        note = f"The room could not be ended in the store ({e}); you have left it here."
    watcher.drop(session_id())
    session().room = None
    if note:
        session().room_notice = note
    st.rerun()


# ---- above the page: the room's line, the watcher, the poll ----------------------------------------------
def room_link(code: str) -> str:
    try:
        u = urlsplit(st.context.url or "")
        base = f"{u.scheme}://{u.netloc}" if u.scheme and u.netloc else ""
    except Exception:          # no request context (tests calling functions directly)
        base = ""
    return f"{base}/?room={code}"


def describe(view: View) -> str:
    title = page_titles().get(view.page, view.page)
    head = "average of heads" if view.head is None else f"head {view.head}"
    return f"{title} · layer {view.layer} · {head} · step {view.step}"


def bar() -> None:
    r = room()
    if r is None:
        return
    if r.error:
        st.warning(plain(r.error))
    if r.role == "teacher":
        st.info(f"**Room {plain(r.code)}** · students open {plain(room_link(r.code))} (or join with the code "
                "in the sidebar's Classroom section) and follow what this screen shows.")
        state, failed = _state_or_error(r.code)
        if failed:
            teacher_offline(r)
            _notify("teacher", r.code, signature("teacher", False))
        elif state is None:
            state = restore(r)       # the store restarted empty: same code, this screen's run and view
        if state is not None:
            answers = _answers(r.code, state)
            _notify("teacher", r.code, signature("teacher", state, answers))
            poll_box(r, state, answers)
        return
    if r.ended:
        watcher.drop(session_id())
        st.info(f"Room {plain(r.code)} has ended. This run stays yours to explore.")
        return
    _student_line(r)
    state = r.state if following() else _safe_state(r.code)
    if not following():
        _notify("detached", r.code, signature("detached", state))
    elif not push_available():
        _poll_fallback()                    # the one route where nothing pushes: it draws the live panel too
    elif state is not None and r.live is not None and not r.error:
        live_panel(r.code, r.live)          # the teacher's run as it generates
    if state is not None:
        poll_box(r, state)


def _notify(kind: str, code: str, seen) -> None:
    """Have this screen rerun when the room no longer matches `seen` (inspector.ui.room_push; polling without it)."""
    if push_available():
        watcher.watch(session_id(), kind, code, seen)
    else:
        _poll_fallback()


def _answers(code: str, state) -> int | None:
    try:
        return None if state.poll is None else _store().answer_count(code, state.poll.id)
    except ROOM_ERRORS:
        return None


def _safe_state(code: str):
    return _state_or_error(code)[0]


def _state_or_error(code: str) -> tuple:
    """(the room's state or None, whether the store failed)."""
    try:
        return _store().state(code), False
    except ROOM_ERRORS:
        return None, True


def _student_line(r: RoomSeat) -> None:
    left, right = st.columns([5, 2], vertical_alignment="center")
    state = r.state
    if following():
        left.markdown(f"**Room {plain(r.code)}** · following the teacher"
                      + (f": {plain(describe(state.view))}" if state is not None else ""))
        right.button("Explore on my own", key="room_detach", on_click=_detach, use_container_width=True,
                     help="Your own copy of the teacher's run: change anything, press Run; the teacher's "
                          "screen is not affected")
    else:
        left.markdown(f"**Room {plain(r.code)}** · exploring on your own")
        right.button("Follow the teacher", key="room_follow", on_click=_follow, type="primary",
                     use_container_width=True)


def _detach() -> None:
    r = room()
    if r is not None:
        r.following, r.widgets = False, None


def _follow() -> None:
    r = room()
    if r is not None:
        r.following, r.version, r.run_id = True, None, None


@st.fragment(run_every=FALLBACK_EVERY_S)
def _poll_fallback() -> None:
    """Only where the watcher cannot rerun a session (inspector.ui.room_push.available): every FALLBACK_EVERY_S, one
    read of the room's state (and its live run, for a following student); the whole app reruns when it changed,
    else a following student's live panel is drawn here (one polling fragment for the run and its live view)."""
    r = room()
    if r is None:
        return
    state, failed = _state_or_error(r.code)
    following_now = r.role == "student" and following()
    if following_now:     # what the last full run drew (before_page): no rerun loop while the store is down
        live = None if failed or state is None else _store().live_seq(r.code)
        changed = signature("follow", False if failed else state, live=live) != r.seen
    else:
        seen = r.fallback_seen
        r.fallback_seen = (None if state is None else (state.poll, _answers(r.code, state)))
        changed = seen is not None and seen != r.fallback_seen
    if changed:
        st.rerun(scope="app")
    if following_now and r.live is not None and not r.error:
        draw_live(r.code, r.live)           # the teacher's run as it generates
