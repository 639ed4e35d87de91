"""The teacher's run while it generates, in a room (inspector.session.rooms_live): the teacher's side starts
publishing when Run is pressed (`publisher`), and a following student's screen shows a live panel above the
page: the prompt, the prefill's progress, the text as it grows, the newest token with its probability and the
model's top candidates. The panel is a fragment that the room's watcher reruns alone when the live run moves
(inspector.ui.room_push.watch_live); where the watcher cannot rerun a session, the room's one polling fragment
draws it (inspector.ui.room._poll_fallback). When the run ends, the teacher's screen publishes it whole and
every student's screen loads it as any room run.

Token texts and the prompt come from the store: they reach the screen as plain text only (st.text, st.code,
Markdown-escaped), never as Markdown or HTML."""
from __future__ import annotations

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from inspector.session.rooms import shared_store
from inspector.session.rooms_live import Live, LivePublisher
from inspector.session.rooms_state import ROOM_ERRORS
from inspector.ui.common import current_run, plain
from inspector.ui.room_push import watcher
from inspector.ui.room_sync import room
from inspector.ui.st_internals import fragment_id
from inspector.views.sampling import describe

# The sidebar's box showing the teacher's prompt to a following student: a label and a code box, not a widget. A
# read-only text area showed a new label a frame before its new value (an empty box that said "generating", caught
# by tests/browser/test_room_follow_cost.py): Streamlit's box takes a value from the server after it is drawn.
TEACHER_PROMPT = "Prompt (the teacher's run)"
GENERATING = "Prompt (the teacher's run, generating)"


def publisher(prompt: str, max_new: int) -> LivePublisher | None:
    """For a teacher's session in a room: the room now shows this run live; the LivePublisher its LiveRun
    tells as it generates. None outside a room, or when the store fails (said on the teacher's screen)."""
    r = room()
    if r is None or r.role != "teacher":
        return None
    code, token = r.code, r.token
    try:
        store = shared_store()
        live = store.start_live(code, token, prompt, max_new)
    except ROOM_ERRORS as e:
        r.error = f"The room could not show this run live: {e}"
        return None
    return LivePublisher(live.seq, prompt, max_new, publish=lambda doc: store.publish_live(code, token, doc),
                         end=lambda seq: store.end_live(code, token, seq))


@st.fragment
def panel(code: str, seq: int) -> None:
    """The live panel of a following student's screen (run `seq` of the room is live), rerun alone by the room's
    watcher when the live run moves."""
    n = draw(code, seq)
    ctx, fid = get_script_run_ctx(), fragment_id()
    if ctx is not None:
        watcher.watch_live(ctx.session_id, code, n, fid)


def draw(code: str, seq: int) -> int:
    """Draw the live run; returns the live counter it drew (0 when the store failed)."""
    try:
        n, live = shared_store().live(code)
    except ROOM_ERRORS as e:
        st.warning(f"The teacher's run is generating, but the room's store does not answer: {plain(e)}")
        return 0
    with st.container(border=True):
        if live is None or live.seq != seq:
            st.markdown("**The teacher's run** is starting…")
            return n
        st.markdown("**The teacher's run**, live · " + plain(_phase(live)))
        st.text(f"Prompt: {live.prompt}")
        if live.phase == "prefill":
            st.progress(live.prefill, text=f"reading the prompt: {live.prefill:.0%}")
        elif live.tokens:
            st.progress(min(1.0, live.tokens / max(1, live.max_new)),
                        text=f"token {live.tokens} of at most {live.max_new}")
            st.code(live.text, language=None, wrap_lines=True)
        if live.last is not None:
            top = ", ".join(f"{t!r} {p:.2f}" for t, p in live.last.top)
            st.text(f"Newest token {live.last.text!r}, chosen with probability {live.last.prob:.2f}; "
                    f"the model's top candidates: {top}")
    return n


def _phase(live: Live) -> str:
    return {"queued": "waiting for a slot on the server", "prefill": "reading the prompt",
            "decode": "generating", "done": f"finished after {live.tokens} tokens: the whole run follows",
            "stopped": f"stopped after {live.tokens} tokens: the run follows as it was",
            "failed": "it ended without a token"}[live.phase]


def teacher_prompt(height: int) -> None:
    """In a following student's sidebar, in place of their own prompt box: the prompt and settings of the
    teacher's run on screen (read-only; the student's own prompt comes back when they explore on their own)."""
    live = _live_now()
    if live is not None:          # the teacher's run generating now (its first in the room, or a new one)
        _prompt_box(GENERATING, live.prompt, height)
        st.caption("The teacher's run is generating: it grows above the page, token by token, and the whole run "
                   "follows when it ends.")
        return
    run = current_run()
    _prompt_box(TEACHER_PROMPT, run.settings.prompt if run is not None else "", height)
    if run is None:
        st.caption("The teacher has not run anything in this room yet.")
        return
    s = run.settings
    st.caption(f"The teacher's settings: chat format {'on' if s.chat else 'off'} · up to {s.max_new_tokens:,} new "
               f"tokens · {plain(describe(s.params))} · seed {s.seed}"
               + (f" · stop strings {plain(', '.join(map(repr, s.stop)))}" if s.stop else ""))


def _prompt_box(label: str, prompt: str, height: int) -> None:
    """A prompt shown read-only, under its label: plain text in a code box of the prompt box's height."""
    st.markdown(f"**{label}**")
    st.code(prompt, language=None, wrap_lines=True, height=height)


def _live_now() -> Live | None:
    """The teacher's run generating now in this student's room (the one this screen shows live), or None."""
    r = room()
    if r is None or r.live is None:
        return None
    try:
        _, live = shared_store().live(r.code)
    except ROOM_ERRORS:
        return None
    return live if live is not None and live.seq == r.live else None
