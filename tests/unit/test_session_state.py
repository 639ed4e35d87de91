"""The app's one typed session object (inspector.session.state): its defaults, the room seat's fields, retention of
kept runs and the memory budget read by field (inspector.session.budget)."""
from __future__ import annotations

import ast
import io
import re
import threading
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from inspector.session.budget import enforce, holdings, session_bytes
from inspector.session.memo import run_key
from inspector.session.rooms_state import View
from inspector.session.state import RoomSeat, SessionState

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


class Run:                       # what retention and the budget see of a run: its creation time, ids and tensors
    def __init__(self, created: float, mib: int = 0, positions: int = 4):
        self.created, self.ids = created, list(range(positions))
        self.t = torch.zeros(mib * MiB // 4)


def test_a_new_session_holds_nothing_and_shares_no_mutable_default():
    a, b = SessionState(), SessionState()
    assert (a.run, a.runs, a.debugger, a.live, a.room, a.selected_step, a.opened) == (None, [], None, None, None, None,
                                                                                      None)
    assert a.memos == {} and a.stopped == {} and a.notices == [] and a.uploads == 0 and not a.teacher_ok
    a.runs.append(1)
    a.memo("att_maps")["k"] = 1
    assert b.runs == [] and b.memos == {} and a.memo("att_maps") == {"k": 1}
    assert a.token is not b.token and a.turn is not b.turn and isinstance(a.turn, type(threading.Lock()))
    with pytest.raises(AttributeError):
        a.rnu = None             # slotted: a misspelt field is an error, not a new key


def test_the_room_seat_declares_every_field_the_room_code_uses():
    seat = RoomSeat.teacher("K7QM2X", "tok")
    assert (seat.role, seat.code, seat.token, seat.view, seat.run_key, seat.published) == ("teacher", "K7QM2X", "tok",
                                                                                          None, None, False)
    student = RoomSeat.student("K7QM2X", "ab" * 16)
    assert (student.role, student.following, student.voter, student.answered, student.ended) == (
        "student", True, "ab" * 16, {}, False)
    view = View("attention", step=2, layer=1, head=0)
    student.view, student.answered[3] = view, 17
    again = RoomSeat(**{f.name: getattr(student, f.name) for f in fields(RoomSeat)})
    assert again == student and again.view is view and again.answered == {3: 17}
    declared = {f.name for f in fields(RoomSeat)}
    used = set()
    for path in (ROOT / "inspector/ui").glob("room*.py"):
        tree = ast.parse(path.read_text())
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id == "r"}
    assert used and used <= declared, used - declared
    assert len(used) >= 16 and not re.search(r"\br\[\"", "".join(p.read_text() for p in (ROOT / "inspector/ui")
                                                                    .glob("room*.py")))


def test_keeping_a_run_trims_the_kept_runs_and_their_memos_by_field():
    s = SessionState(selected_step=3)
    r1, r2, r3 = Run(1.0), Run(2.0), Run(3.0)
    s.memo("att_maps")[run_key(r1)] = "r1's map"
    s.memo("rep_attn")[(run_key(r1), 5)] = "r1's copy heads"
    s.memo("att_maps")[run_key(r2)] = "r2's map"
    s.memo("nd_reports")["other"] = "kept"
    assert s.keep(r1, 2) == [] and s.keep(r2, 2) == []
    assert s.run is r2 and s.runs == [r1, r2] and s.selected_step is None
    assert s.keep(r3, 2) == [r1]
    assert s.runs == [r2, r3] and s.run is r3
    assert s.memos == {"att_maps": {run_key(r2): "r2's map"}, "rep_attn": {}, "nd_reports": {"other": "kept"}}
    assert s.keep(r2, 2) == [] and s.runs == [r3, r2] and s.run is r2          # kept again: now the newest
    s.selected_step = 1
    s.show(r3)
    assert s.run is r3 and s.selected_step is None and s.runs == [r3, r2]


def test_the_budget_reads_the_session_by_field_and_never_drops_the_run_on_screen():
    current, earlier, opened, live = Run(2.0, 10), Run(1.0, 10), Run(0.5, 20), Run(0.1, 30)
    s = SessionState(run=current, runs=[earlier, current], opened=("big.trace", "digest", opened))
    s.live = live
    s.memo("att_maps")["k"] = torch.zeros(MiB // 4)
    s.memo("att_maps")[run_key(current)] = current.t            # the run's own tensor: never counted as droppable
    widgets = {"tf_upload_1": io.BytesIO(b"\x01" * (3 * MiB)), "sb_prompt": "x" * 10, "_session": s}
    listed = [(h.key, h.name, h.rank, h.label) for h in holdings(s, widgets)]
    assert listed == [("memos", "att_maps", 0, "a cached view (att_maps)"),
                      ("widgets", "sb_prompt", 0, "a cached view (sb_prompt)"),
                      ("opened", None, 1, "a trace file"), ("widgets", "tf_upload_1", 1, "a trace file"),
                      ("runs", None, 3, "an earlier run (4 positions)")]
    assert 0 <= session_bytes(s, widgets) - (10 + 10 + 20 + 30 + 1 + 3) * MiB < 1000
    dropped = enforce(s, 54 * MiB, widgets)
    assert dropped == ["a cached view (att_maps), 1.0 MiB", "a cached view (sb_prompt), 0.0 MiB",
                       "a trace file, 20.0 MiB"]
    assert s.opened is None and s.run is current and s.live is live and s.runs == [earlier, current]
    assert "sb_prompt" not in widgets and "tf_upload_1" in widgets and widgets["_session"] is s
    assert list(s.memos["att_maps"]) == [run_key(current)]
    assert enforce(s, 1, widgets)[-1] == "an earlier run (4 positions), 10.0 MiB"
    assert s.runs == [current] and s.run is current and "tf_upload_1" not in widgets
