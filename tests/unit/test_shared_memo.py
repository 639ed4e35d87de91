"""The process-wide memo a room's students share (inspector.session.memo.SHARED): thirty sessions asking for
the same view at once compute it once; a computation that fails leaves the next caller to compute; bounds
hold; only a room's run goes there, keyed by its content; and a figure drawn by many sessions is styled once
(inspector.session.memo.styled_once)."""
from __future__ import annotations

import gc
import threading
import time

import plotly.graph_objects as go
import pytest
import torch

import inspector.session.memo as memo_module
from engine import RunSettings
from engine.inspection.trace import from_bytes, to_bytes
from inspector.session.memo import SHARED, SharedMemo, content_key, memo, run_key, styled_once, view_store
from inspector.session.run import inspect_run
from inspector.views.theme import styled


def test_thirty_callers_at_once_compute_once_and_share_the_value():
    shared, calls, out = SharedMemo(), [], [None] * 30
    start = threading.Barrier(30)

    def compute():
        calls.append(1)
        time.sleep(0.1)                  # long enough for every other caller to arrive while it runs
        return object()

    def session(k):
        start.wait()
        out[k] = memo(shared, ("room-run", "ab", None, "map", 1), compute)
    threads = [threading.Thread(target=session, args=(k,)) for k in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and shared.computed == 1
    assert all(v is out[0] for v in out) and out[0] is not None


def test_a_failed_computation_is_not_kept_and_the_next_caller_computes():
    shared, n = SharedMemo(), []

    def fails():
        n.append(1)
        raise RuntimeError("stopped")
    with pytest.raises(RuntimeError):
        shared.get("k", fails)
    assert "k" not in shared
    assert shared.get("k", lambda: 7) == 7 and shared.get("k", fails) == 7 and len(n) == 1


def test_bounds_drop_the_least_recently_used():
    shared = SharedMemo(max_entries=3, max_bytes=10 << 20)
    for k in range(3):
        shared.get(k, lambda k=k: k)
    shared.get(0, lambda: None)                                      # 0 used last: 1 goes first
    shared.get(3, lambda: 3)
    assert [k in shared for k in range(4)] == [True, False, True, True]
    shared.get("big", lambda: {"probs": torch.zeros(3 << 20)})      # 12 MiB, nested in a dict: counted
    assert len(shared) == 1 and "big" in shared                       # the newest stays, however big


def test_only_a_rooms_run_is_shared_and_its_key_is_its_content(tiny_model):
    run = inspect_run(tiny_model, RunSettings(prompt="one two three", chat=False, max_new_tokens=3))
    own: dict = {}
    assert view_store(run, own) is own and content_key(run, tiny_model) == run_key(run)
    data = to_bytes(run)
    copies = [from_bytes(data) for _ in range(2)]          # two students' sessions, one room run
    for c in copies:
        c.extra["room_run_id"] = "cd" * 16
    assert all(view_store(c, own) is SHARED for c in copies)
    assert content_key(copies[0], tiny_model) == content_key(copies[1], tiny_model) != run_key(copies[0])
    other = from_bytes(data)
    other.extra["room_run_id"] = "ef" * 16
    assert content_key(other, tiny_model) != content_key(copies[0], tiny_model)
    assert content_key(copies[0], None) != content_key(copies[0], tiny_model)    # the model is part of the key


def test_a_figure_is_styled_once_per_mode_while_it_lives(monkeypatch):
    gc.collect()            # earlier tests' figures that are garbage already (in cycles) leave the memo first
    made = []
    monkeypatch.setattr(memo_module, "styled", lambda fig, projector=False: made.append(projector) or styled(
        fig, projector=projector))
    fig = go.Figure(go.Bar(x=["a", "b"], y=[1, 2]))
    first = styled_once(fig)
    assert styled_once(fig) is first and made == [False]
    assert styled_once(fig, projector=True) is not first and made == [False, True]
    assert first.to_plotly_json() == styled(fig).to_plotly_json()
    n = len(memo_module._styled)
    del fig, first
    gc.collect()
    assert len(memo_module._styled) == n - 2                                 # gone with the figure
