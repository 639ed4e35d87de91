"""Issue 31, items 1 and 7: a room's run is parsed once per process and shared by every following session
(thirty followers: one parse, one copy in memory), and it goes when the last session lets it go."""
from __future__ import annotations

import gc
import threading
import time

import pytest

from inspector.session.room_runs import SharedRuns

pytestmark = pytest.mark.unit


class Run:
    """Stands for a parsed Trace (weakly referenceable, like Trace)."""


def test_thirty_followers_asking_at_once_cause_one_parse_and_share_its_result():
    runs, parses = SharedRuns(), []
    start = threading.Barrier(30)
    got: list = []

    def parse():
        parses.append(1)
        time.sleep(0.05)                   # a parse that takes a while: the others wait for it
        return Run()

    def follower():
        start.wait()
        got.append(runs.get(("abc", "bounds"), parse))
    threads = [threading.Thread(target=follower) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(parses) == 1 == runs.parsed and len(got) == 30 and all(r is got[0] for r in got)
    assert runs.get(("abc", "other bounds"), Run) is not got[0]             # validated against other bounds


def test_the_run_goes_with_the_last_session_that_holds_it_and_a_failed_parse_is_tried_again():
    runs = SharedRuns()
    held = runs.get("r1", Run)
    assert len(runs) == 1 and runs.get("r1", Run) is held
    del held
    gc.collect()
    assert len(runs) == 0

    def broken():
        raise ValueError("not a trace")
    with pytest.raises(ValueError):
        runs.get("r2", broken)
    assert isinstance(runs.get("r2", Run), Run)
