"""One click at a time per session: a session's script runs take turns to draw a page and do its model work
(app.py holds the turn around the page; a run started from the sidebar knows whether the previous click still
holds it, inspector.session.live_run)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import streamlit as st

from inspector.session.live_run import StillFinishing
from inspector.ui.state import session

PREVIOUS_WAIT_S = 30.0       # how long a click waits for this session's previous one to finish its page
STILL_FINISHING = StillFinishing.message


def page_turn() -> threading.Lock:
    """This session's turn to draw a page (and do its model work)."""
    return session().turn


@contextmanager
def own_turn(wait_s: float | None = None):
    """Hold this session's turn while the page runs (app.py). A click while the page still computes starts a
    new script run at once (Streamlit's fast reruns), and the previous one ends only at its next Streamlit call
    (the next token or layer), holding its device slot until then. Without a turn, a quick Continue, Run to
    end, Step gave three script runs of one tab in the queue, and the third was refused as if another tab held
    the first two. So a new click waits here for the previous one, saying so; after wait_s (PREVIOUS_WAIT_S)
    it says to try again and stops. A still newer click ends the waiting one at its next note."""
    turn, wait_s = page_turn(), PREVIOUS_WAIT_S if wait_s is None else wait_s
    held = turn.acquire(blocking=False)
    try:
        if not held:
            note, end = st.empty(), time.monotonic() + wait_s
            while not held:
                left = end - time.monotonic()
                if left <= 0:
                    note.warning(STILL_FINISHING)
                    st.stop()
                note.info(f"Your previous click is still finishing; this one follows as soon as it has "
                          f"(waiting at most {left:,.0f} s more).")
                held = turn.acquire(timeout=min(0.25, left))
            note.empty()
        yield
    finally:
        if held:
            turn.release()
