"""One browser session's state, typed: the run on screen, the runs kept, the page memos, the debugger, the room
seat and the few flags the app carries from one script run to the next. The app keeps one SessionState per
session under one key of st.session_state (inspector.ui.state.session); widget values stay in st.session_state,
where Streamlit needs them. Retention (`keep`, `show`), the memory budget (inspector.session.budget) and rooms
read and write it by field. Knows nothing of Streamlit.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inspector.session.clients import SessionToken
from inspector.session.memo import run_key

if TYPE_CHECKING:
    from engine import Trace
    from inspector.session.live_run import LiveRun
    from inspector.session.rooms_state import RoomState, View
    from inspector.session.stepper import Debugger


@dataclass(slots=True)
class RoomSeat:
    """This session's place in a room (inspector.ui.room): a teacher's or a student's. Slotted: a field the room
    code writes must be declared here."""
    role: str                               # "teacher" | "student"
    code: str                               # the room's code
    run_id: str | None = None               # the room's run this screen holds (published or loaded)
    error: str | None = None                # what went wrong with the room, said above the page
    fallback_seen: Any = None               # (poll, answers) the polling fragment last saw, where nothing pushes
    # the teacher's side
    token: str | None = None                # the publish token: stays on the server
    page: str | None = None                 # the page the teacher's screen shows
    view: View | None = None                # the view last published
    run_key: tuple | None = None            # the run last published (inspector.session.memo.run_key)
    published: bool = False                 # whether `view` reached the store
    # the student's side
    following: bool = True                  # False: exploring on their own
    version: int | None = None              # the room's state version this screen applied
    live: int | None = None                 # the teacher's run generating now, shown live (its number in the room)
    voter: str | None = None                # the name this browser's answers are kept under (room_sync.voter_id)
    answered: dict[int, int] = field(default_factory=dict)   # poll id -> the token id this browser answered
    ended: bool = False                     # the teacher ended the room
    state: RoomState | None = None          # the room's state the last full script run applied
    seen: Any = None                        # what this screen shows of the room (inspector.ui.room_push.signature)
    widgets: dict | None = None             # widget key -> the value a following student's widget must show

    @classmethod
    def teacher(cls, code: str, token: str) -> RoomSeat:
        return cls("teacher", code, token=token)

    @classmethod
    def student(cls, code: str, voter: str) -> RoomSeat:
        return cls("student", code, voter=voter)


@dataclass(slots=True, weakref_slot=True, eq=False)
class SessionState:
    """Everything one session keeps between script runs that is not a widget's value (slotted: every field
    declared here). One object per session, equal only to itself: the model registry (inspector.session.models)
    knows each session by a weak reference to it."""
    # runs
    run: Trace | None = None                # the run the pages show
    runs: list = field(default_factory=list)   # the runs kept, oldest first (at most max_runs_kept)
    selected_step: int | None = None        # the step the debugger shows; other pages start there
    live: LiveRun | None = None             # this session's run while it generates
    notices: list[tuple[str, str]] = field(default_factory=list)   # (st function, text) the end of a run said
    run_pressed: bool = False               # Run was clicked: its callback, before the script draws it
    history_newest: float | None = None     # the newest kept run the history box has shown
    own_prompt: str | None = None           # a student's own prompt while the sidebar shows the teacher's
    prompt_tokens: dict = field(default_factory=dict)   # (model, prompt, chat, special) -> its token count
    # the models (what inspector.session.models reads: which it may unload to make room, whom to tell)
    model_key: tuple | None = None          # the registry's key of the model the sidebar chose
    models_used: dict = field(default_factory=dict)   # registry key -> when this session last had it (monotonic)
    model_notice: str | None = None         # the chosen model was unloaded to make room and loaded again: said once
    # the debugger
    debugger: Debugger | None = None
    breakpoints: list = field(default_factory=list)
    # derived data, dropped first by the budget
    memos: dict[str, dict] = field(default_factory=dict)   # a page's memo store by name: run key ... -> value
    stopped: dict[str, str] = field(default_factory=dict)  # on-demand computation tag -> "stopped" | "again"
    compared: dict | None = None            # the Compare page's last comparison
    determinism: dict | None = None         # the Compare page's last determinism check (its report's dict)
    steered: dict | None = None             # the Compare page's last steering (plain and steered runs)
    qk: tuple | None = None                 # the Attention page's last score split: (what it split, its dict)
    atlas: dict | None = None               # the Attention page's head atlas last shown (HeadAtlas.as_dict)
    lens: dict | None = None                # the Activations page's last tuned lens at a position (report's dict)
    atlas_refused: str | None = None        # why the head atlas's last scatter click was ignored: said once
    opened: tuple | None = None             # (name, digest, Trace or error) of a trace file just opened
    uploads: int = 0                        # trace files opened so far (a new uploader after each)
    sampling_for: float | None = None       # the run (.created) the Sampling page's columns were set for
    # demos
    demo: str | None = None                 # the demo whose run the sidebar should start
    lesson: tuple | None = None             # (demo, its run's .created): that run's page says the lesson
    autorun: bool = False                   # a demo asked the NaN doctor to run its fault run
    # rooms
    room: RoomSeat | None = None
    teacher_ok: bool = False                # this session entered the teacher key
    link_tried: str | None = None           # the ?room= code already tried (a bad link is tried once)
    link_waiting: str | None = None         # the ?room= code whose join waits for the store to answer
    room_notice: str | None = None          # how the room was left, said once in the Classroom section
    join_error: str | None = None           # why joining from a link failed, said once
    # the app's own
    token: SessionToken = field(default_factory=SessionToken)   # counts this session for its browser
    turn: threading.Lock = field(default_factory=threading.Lock)   # held by the script run drawing the page
    projector: bool | None = None           # projector mode, kept across page switches made by the script
    frame_rerun: bool = False               # the frame work-around reran this session once (inspector.ui.frame)

    def memo(self, name: str) -> OrderedDict:
        """The page memo store `name` (created empty)."""
        return self.memos.setdefault(name, OrderedDict())

    def keep(self, record: Trace, max_runs: int) -> list:
        """Make `record` the current run and keep it; drop the oldest runs beyond max_runs and what the page
        memos hold for them (keyed by memo.run_key(run) or a tuple starting with it). Returns the runs dropped."""
        runs = [r for r in self.runs if r is not record] + [record]
        dropped, self.runs = runs[:-max_runs], runs[-max_runs:]
        self.run, self.selected_step = record, None       # the debugger's step belongs to the debugger's run
        gone = {run_key(r) for r in dropped}
        for store in self.memos.values() if gone else []:
            for k in [k for k in store if k in gone or (isinstance(k, tuple) and k and k[0] in gone)]:
                del store[k]
        return dropped

    def held_models(self) -> list:
        """The models this session's own objects hold (its debugger's, its run's while it generates), whatever the
        sidebar now shows: none of them can be unloaded."""
        held = [] if self.debugger is None else [self.debugger.run.model]
        live = self.live
        model = None if live is None or live.done or live.model_ref is None else live.model_ref()
        if model is not None:
            held.append(model)
        return held

    def show(self, run: Trace) -> None:
        """Show a kept run again (the history box)."""
        self.run, self.selected_step = run, None
