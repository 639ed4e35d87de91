"""Everything a session holds counts against its budget (issue 19, item 5): an opened upload (a tuple, not a
page memo), an uploaded file's bytes, any whole value; what the budget may drop is everything but the run on
screen and the app's own state (a run generating, a room seat). The budget reads the session's SessionState by
field, and its widget values."""
from __future__ import annotations

import io

import pytest
import torch

from inspector.session.budget import data_allowance, enforce, holdings, nbytes, session_bytes, trace_file_limit
from inspector.session.limits import Limits
from inspector.session.state import SessionState

pytestmark = pytest.mark.unit
MiB = 2**20


class Run:                      # what budget sees of a run: its tensors
    def __init__(self, mib: int, positions: int = 4):
        self.t = torch.zeros(mib * MiB // 4)
        self.ids = list(range(positions))


def test_an_uploaded_file_counts_its_bytes():
    up = io.BytesIO(b"\x01" * (3 * MiB))
    assert nbytes(up) == 3 * MiB
    assert session_bytes(SessionState(), {"tf_upload_0": up}) == 3 * MiB + len("tf_upload_0")   # the key's text too


def test_an_opened_upload_is_counted_and_dropped_before_earlier_runs_never_the_run_on_screen():
    current, earlier, opened, live = Run(10), Run(10), Run(20), Run(30)
    state = SessionState(run=current, runs=[earlier, current], opened=("big.trace", "digest", opened), live=live,
                         memos={"att_maps": {"k": torch.zeros(MiB // 4)}})
    listed = [(h.key, h.name, h.rank) for h in holdings(state)]
    assert listed == [("memos", "att_maps", 0), ("opened", None, 1), ("runs", None, 3)]   # not the run, not live
    assert 0 <= session_bytes(state) - (10 + 10 + 20 + 30 + 1) * MiB < 200            # and the file's name
    dropped = enforce(state, 50 * MiB + 1000)
    assert dropped == ["a cached view (att_maps), 1.0 MiB", "a trace file, 20.0 MiB"]
    assert state.opened is None and state.run is current and state.live is live
    assert state.runs == [earlier, current]                                    # 50 MiB: fits now


def test_a_trace_file_may_take_half_a_sessions_allowance():
    for mb in (1, 64, 400):
        assert trace_file_limit(Limits(max_session_mb=mb)) == data_allowance(mb) // 2 == int(mb * MiB * 0.8) // 2
