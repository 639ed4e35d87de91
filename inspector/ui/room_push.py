"""How a student's screen learns that the teacher changed something: one watcher thread per app process reads
each followed room's small state document every POLL_S (one read per room, however many students follow it)
and asks Streamlit to rerun exactly the sessions whose screen is behind. Nothing polls in the browsers.

Each session says what its screen shows when it draws it (`watch(kind, code, seen)`):
  "follow"   the room's version it applied and the live run it shows, if any (a following student);
  "detached" the poll it showed (a student exploring on their own still sees a poll open or its answers);
  "teacher"  the poll and its number of answers (the teacher's count goes up as answers arrive).
When the store says otherwise, the watcher requests a rerun of that session with its last client state, as
if its browser had asked (the page, query and widget values stay). At most one rerun per session per
MIN_GAP_S for answer counts; a version change reruns at once. A store that stops answering is a state of its
own (OFFLINE): each screen reruns once to say that the room is reconnecting, and once more when it answers.

One route carries a run to a following screen: this watcher, with one signature per screen. When a run of
the teacher's starts (its live document appears) or ends (its full run is published under a new version, or
it ended with nothing to show), the signature changes and the whole screen reruns, once each; while it
generates, the screen's live panel, a fragment that says its id (`watch_live`), is rerun alone whenever the
room's live counter moves (at most LIVE_RERUNS_S panel reruns a second in a process, shared by its
followers). Where the watcher cannot rerun sessions, one polling fragment does the same
(inspector.ui.room._poll_fallback).

Streamlit has no public API for a server-side rerun: `_rerun` goes through inspector.ui.st_internals, the one
module that touches Streamlit's internals. Where they are missing, `available()` is False and the room falls
back to that polling fragment.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from inspector.session.rooms import shared_store
from inspector.session.rooms_state import ROOM_ERRORS, RoomState
from inspector.ui import st_internals

POLL_S = 0.1          # how often the watcher reads each followed room
MIN_GAP_S = 0.5       # answer counts rerun a teacher's screen at most this often
# Live panels rerun, all of this process's together, at most this often a second. One rerun of a panel costs the
# process about 17 ms of CPU (Streamlit's script run around it; measured with ten followers on the 2-core test
# machine): unbounded, ten followers rerunning at every publish (up to 7 a second each) took more CPU than the
# teacher's own run and made it 4.6 times slower. So each panel reruns at most every followers / LIVE_RERUNS_S
# seconds (never more often than POLL_S): 3 followers 0.15 s, 10 followers 0.5 s, 30 followers 1.5 s.
LIVE_RERUNS_S = 20
OFFLINE = "offline"   # the signature of a room whose store does not answer
FALLBACK_EVERY_S = 1.0   # where the watcher cannot rerun sessions (available()), how often a screen polls
log = logging.getLogger("llm_inspector")


@dataclass
class _Sub:
    kind: str
    code: str
    seen: object
    asked_at: float = 0.0
    fragment: str | None = None       # the live panel's fragment id, while the teacher's run generates
    live_seen: int = 0
    live_at: float = 0.0              # when its live panel was last rerun


def signature(kind: str, state: RoomState | None | bool, answers: int | None = None,
              live: int | None = None) -> object:
    """What a screen of this kind must show of the room's state (None: the room is gone; False: the store
    does not answer); `live`: the number of the teacher's run generating now (None: none)."""
    if state is False:
        return OFFLINE
    if state is None:
        return None
    if kind == "follow":
        return state.version, live
    poll = state.poll
    poll_sig = None if poll is None else (poll.id, poll.revealed)
    return (poll_sig, answers) if kind == "teacher" else poll_sig


def available() -> bool:
    """Whether this Streamlit lets the watcher rerun a session (else the page polls)."""
    return st_internals.available()


def _rerun(session_id: str, fragment: str | None = None) -> bool:
    return st_internals.rerun_session(session_id, fragment)


class Watcher:
    def __init__(self, poll_s: float = POLL_S, rerun=_rerun) -> None:
        self._subs: dict[str, _Sub] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.poll_s, self.rerun = poll_s, rerun

    def watch(self, session_id: str, kind: str, code: str, seen) -> None:
        """A full script run of this session drew `seen` (a live panel, if any, says so after: watch_live)."""
        with self._lock:
            sub = self._subs.get(session_id)
            if sub is None or (sub.kind, sub.code) != (kind, code):
                self._subs[session_id] = _Sub(kind, code, seen)
            else:
                sub.seen, sub.fragment = seen, None
            self._start()

    def watch_live(self, session_id: str, code: str, seen: int, fragment: str | None) -> None:
        """This session's live panel (fragment id) drew the room's live counter `seen`."""
        with self._lock:
            sub = self._subs.get(session_id)
            if sub is None or sub.code != code:
                return
            sub.fragment, sub.live_seen = fragment, seen
            self._start()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True, name="llm-inspector-rooms")
                self._thread.start()

    def drop(self, session_id: str) -> None:
        with self._lock:
            self._subs.pop(session_id, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            try:
                self.tick()
            except Exception:            # a store that fails now may answer at the next tick
                log.debug("room watcher tick failed", exc_info=True)

    def tick(self) -> None:
        with self._lock:
            subs = dict(self._subs)
        states: dict[str, tuple] = {}
        now = time.monotonic()
        live_gap = max(self.poll_s, sum(1 for s in subs.values() if s.fragment) / LIVE_RERUNS_S)
        for sid, sub in subs.items():
            if sub.code not in states:
                states[sub.code] = self._read(sub.code, any(s.kind == "follow" and s.code == sub.code
                                                            for s in subs.values()))
            state, answers, live, live_seq = states[sub.code]
            sig = signature(sub.kind, state, answers, live_seq)
            if sig == sub.seen:
                if sub.fragment and live is not None and live != sub.live_seen and now - sub.live_at >= live_gap:
                    sub.live_seen, sub.live_at = live, now
                    if not self.rerun(sid, sub.fragment):
                        self.drop(sid)
                continue
            if sub.kind == "teacher" and now - sub.asked_at < MIN_GAP_S:
                continue
            sub.seen, sub.asked_at = sig, now
            if not self.rerun(sid):
                self.drop(sid)

    @staticmethod
    def _read(code: str, followed: bool) -> tuple:
        """(state, or None when gone, or False when the store fails; the open poll's answers; the live counter
        and the live run's number, when a student follows)."""
        try:
            store = shared_store()
            state = store.state(code)
            answers = None
            if state is not None and state.poll is not None:
                answers = store.answer_count(code, state.poll.id)
            if not followed or state is None:
                return state, answers, None, None
            n, doc = store.live(code)
            return state, answers, n, None if doc is None else doc.seq
        except ROOM_ERRORS:
            return False, None, None, None


watcher = Watcher()
