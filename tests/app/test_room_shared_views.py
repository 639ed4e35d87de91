"""A room's students share what their pages derive from the teacher's run (issue 19, item 10: thirty students
following the teacher must not make the server compute each view thirty times). Two students' sessions,
run the way Streamlit runs them (AppTest of the app), follow a room whose teacher shows layer 1 of the
Attention page: the map is computed by one forward, the second session takes it, and both draw the same
chart; then the Sampling page at step 2: its chains and figures are computed once. The run itself is parsed
once and shared by both sessions (issue 31)."""
from __future__ import annotations

import json

import pytest

from engine import RunSettings
from engine.inspection.trace import to_bytes
from inspector.session.memo import SHARED
from inspector.session.room_runs import ROOM_RUNS
from inspector.session.rooms import shared_store
from inspector.session.rooms_state import View
from inspector.session.run import inspect_run
from inspector.ui.state import session_of
from tests.app.test_app_pages_b import fresh_app

pytestmark = pytest.mark.app


def chart_spec(at, key: str) -> dict:
    (el,) = [e for e in at.get("plotly_chart") if e.key == key]
    return json.loads(el.proto.spec)


def student(app_file, source: str, code: str):
    at = fresh_app(app_file, source)
    at.query_params["room"] = code
    at.run()
    assert not at.exception, at.exception
    return at


def test_students_following_a_room_share_each_view(monkeypatch, tiny_model, tiny_model_dir, app_file):
    import inspector.views.attention as attention
    import inspector.views.sampling as sampling
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.delenv("LLM_INSPECTOR_ROOMS", raising=False)
    calls = {"pattern": 0, "redraw": 0}
    real_pattern, real_redraw = attention.attention_pattern, sampling.redraw

    def pattern(*a, **kw):
        calls["pattern"] += 1
        return real_pattern(*a, **kw)

    def redraw(*a, **kw):
        calls["redraw"] += 1
        return real_redraw(*a, **kw)
    monkeypatch.setattr(attention, "attention_pattern", pattern)
    monkeypatch.setattr(sampling, "redraw", redraw)
    SHARED.clear()
    store = shared_store()
    code, token = store.create()
    run = inspect_run(tiny_model, RunSettings(prompt="Tell me about caches.", chat=False, max_new_tokens=5))
    store.publish(code, token, run=to_bytes(run), view=View("attention", layer=1))

    parsed = ROOM_RUNS.parsed
    a = student(app_file, str(tiny_model_dir), code)
    b = student(app_file, str(tiny_model_dir), code)
    for at in (a, b):
        assert session_of(at.session_state).room.following
        assert any("following the teacher: Attention · layer 1" in m.value.replace("\\", "") for m in at.markdown)
    assert calls["pattern"] == 1                  # one forward for the class, not one per student
    assert chart_spec(a, "att_map") == chart_spec(b, "att_map")
    # issue 31: one parsed copy of the room's run per process, shared by its followers (was: a copy each)
    assert session_of(a.session_state).run is session_of(b.session_state).run
    assert ROOM_RUNS.parsed == parsed + 1

    store.publish(code, token, view=View("sampling", step=2, layer=1))
    for at in (a, b):
        at.run()
        assert not at.exception, at.exception
    assert calls["redraw"] == 1
    assert chart_spec(a, "smp_compare_fig") == chart_spec(b, "smp_compare_fig")
    assert a.number_input(key="smp_step").value == b.number_input(key="smp_step").value == 2
