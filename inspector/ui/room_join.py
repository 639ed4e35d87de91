"""Joining a room as a student: by a link (`/?room=CODE`, tried when the session first runs with it) or by the
code typed in the sidebar. A code that names no room is said once, and counts against this browser's tries
(inspector.session.rooms_keys.failed_joins). A store that does not answer now (rooms_state.STORE_DOWN: no
answer within its timeout, or no connection) says nothing about the code: the screen says that it joins as soon
as the store answers, and the room's watcher reruns it then (inspector.ui.room_push; where the watcher cannot
rerun a session, a fragment polls the store), so a class opening the link during a blip of the store still
joins, every student, without pressing anything.

    from_link()     in every script run, before the page (inspector.ui.room.before_page)
    join_form()     the sidebar's form: a code and a Join button
"""
from __future__ import annotations

import streamlit as st

from inspector.session.rooms import shared_store
from inspector.session.rooms_keys import failed_joins
from inspector.session.rooms_state import ROOM_ERRORS, STORE_DOWN, check_code
from inspector.session.state import RoomSeat
from inspector.ui.common import client_key, plain
from inspector.ui.room_push import FALLBACK_EVERY_S, OFFLINE, watcher
from inspector.ui.room_push import available as push_available
from inspector.ui.room_sync import session_id, voter_id
from inspector.ui.state import session


def join(code: str) -> str | None:
    """Follow room `code`; the error to show, or None. Unknown codes count against this browser's tries.
    Raises STORE_DOWN when the store does not answer (the code is neither accepted nor refused)."""
    who = client_key() or "anonymous"
    try:
        code = check_code(code)
        state = shared_store().state(code)
    except STORE_DOWN:
        raise
    except ROOM_ERRORS as e:
        return str(e)
    if state is None:
        if not failed_joins.allow(who):
            return "Too many unknown room codes tried from this browser: wait a minute and try again."
        return f"There is no room {code} (ended, expired, or mistyped)."
    session().room = RoomSeat.student(code, voter_id(code))
    return None


def waiting(code: str, reason) -> str:
    return (f"Joining room {code}: the room's store does not answer ({reason}). This screen joins the room by "
            "itself as soon as it does.")


def from_link() -> None:
    """Join the room of the link this session was opened with: once, unless the store did not answer."""
    ss = session()
    # the code waiting is kept here too: a rerun the watcher asks for while this session's first script run is
    # still going carries no query string (Streamlit saves a session's query string when its run ends)
    code = st.query_params.get("room") or ss.link_waiting
    if not code or ss.link_tried == code:
        return
    try:
        err = join(code)
    except STORE_DOWN as e:           # not tried yet: the next script run tries again, and one comes by itself
        ss.join_error, ss.link_waiting = waiting(code, e), code
        _rerun_when_answering(code)
        return
    ss.link_tried, ss.link_waiting = code, None
    if err:
        ss.join_error = err
        watcher.drop(session_id())    # a wait for the store, if there was one, is over


def _rerun_when_answering(code: str) -> None:
    if push_available():
        watcher.watch(session_id(), "follow", code, OFFLINE)   # rerun once the room's state reads otherwise
    else:
        _retry(code)


@st.fragment(run_every=FALLBACK_EVERY_S)
def _retry(code: str) -> None:
    """Polls the store while a link's join waits for it (only where the watcher cannot rerun sessions)."""
    try:
        shared_store().state(check_code(code))
    except ROOM_ERRORS:
        return
    st.rerun(scope="app")


def join_form() -> None:
    ss = session()
    err, ss.join_error = ss.join_error, None
    if err:
        st.error(plain(err))
    code = st.text_input("Room code", key="room_code", max_chars=12, placeholder="e.g. K7QM2X")
    if st.button("Join", key="room_join", disabled=not code):
        try:
            err = join(code)
        except STORE_DOWN as e:
            err = f"The room's store does not answer ({e}): press Join again in a moment."
        if err:
            st.error(plain(err))
        else:
            st.rerun()
