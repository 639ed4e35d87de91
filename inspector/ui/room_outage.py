"""When the room's store fails or forgets (issue 23, item 2). Redis is run without persistence, so a restart
empties it: every room, its run and its polls are gone, while the teacher's session still holds the room's
code, publish token, view and run. Then:

  - a student's screen says that the room is reconnecting (not that it ended: only the teacher ends a room,
    and the store then keeps a note of it, RoomStore.was_ended) and follows again by itself when it is back;
  - the teacher's screen re-opens the room under the same code from what it holds (`restore`), so the
    students' screens find it again; an open poll is not restored (its answers were in the store).

While the store does not answer at all, both screens say so, and the room's watcher reruns them when it
answers again (inspector.ui.room_push, OFFLINE)."""
from __future__ import annotations

import streamlit as st

from engine.inspection.trace import to_bytes
from inspector.session.memo import run_key
from inspector.session.rooms import shared_store
from inspector.session.rooms_state import ROOM_ERRORS, View
from inspector.session.state import RoomSeat
from inspector.ui.common import plain
from inspector.ui.state import session

RECONNECTING = "The room is reconnecting"
LOST = (f"{RECONNECTING}: its store restarted and lost it. This screen follows the teacher again as soon as "
        "the teacher's screen re-opens it (it does so by itself).")


def offline(reason) -> str:
    return (f"{RECONNECTING}: the room's store does not answer ({reason}). This screen follows the teacher again "
            "as soon as it does.")


def held_run(r: RoomSeat):
    """The teacher's run the room showed (this session keeps it), or None."""
    for run in reversed(session().runs):
        if run_key(run) == r.run_key:
            return run
    return None


def restore(r: RoomSeat):
    """Re-open the teacher's room the store lost, same code, with its view and run; the new state, or None
    (what happened is said on the teacher's screen)."""
    run = held_run(r)
    try:
        state = shared_store().restore(r.code, r.token, view=r.view or View(),
                                       run=to_bytes(run) if run is not None else None)
    except ROOM_ERRORS as e:
        st.warning(f"Room {plain(r.code)} is no longer in the store and could not be re-opened ({plain(e)}): "
                   "press **End the room** in the sidebar's Classroom section, then start a new one.")
        return None
    r.run_id, r.error = state.run_id, None
    st.info(f"The room's store had lost room {plain(r.code)} (it restarted): this screen re-opened it under the "
            "same code, with its run and view. Students' screens follow again by themselves.")
    return state


def teacher_offline(r: RoomSeat) -> None:
    st.warning(f"Room {plain(r.code)}: the room's store does not answer. Students' screens say that the room "
               "is reconnecting; this screen publishes again as soon as the store answers.")
