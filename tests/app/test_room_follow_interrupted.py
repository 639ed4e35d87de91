"""A student's screen that Streamlit stops while it loads the teacher's new run (the watcher's next rerun
arrives mid-load: the run's end bumps the room's version twice, once for the run and once for the view)
loads that run at its next script run; before, the run id counted as tried and the screen stayed without
the run for good (CI: test_rooms_redis, two of ten students never showed the run)."""
from __future__ import annotations

import pytest
from streamlit.runtime.scriptrunner_utils.exceptions import StopException

from engine import RunSettings
from engine.inspection.trace import to_bytes
from inspector.session.rooms import shared_store
from inspector.session.rooms_state import View
from inspector.session.run import inspect_run
from inspector.ui.state import session_of
from tests.app.test_app_pages_b import fresh_app

pytestmark = pytest.mark.app


def test_a_load_stopped_by_a_newer_rerun_is_tried_again(monkeypatch, tiny_model, tiny_model_dir, app_file):
    import inspector.ui.room as room
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.delenv("LLM_INSPECTOR_ROOMS", raising=False)
    store = shared_store()
    code, token = store.create()
    at = fresh_app(app_file, str(tiny_model_dir))
    at.query_params["room"] = code
    at.run()
    assert not at.exception, at.exception
    assert session_of(at.session_state).room.following and session_of(at.session_state).run is None

    run = inspect_run(tiny_model, RunSettings(prompt="Tell me about caches.", chat=False, max_new_tokens=4))
    store.publish(code, token, run=to_bytes(run), view=View("overview"))
    real_keep, calls = room.keep_run, []

    def stopped_once(*a, **kw):             # what a newer rerun does to this script run (fastReruns)
        calls.append(1)
        if len(calls) == 1:
            raise StopException()
        return real_keep(*a, **kw)
    monkeypatch.setattr(room, "keep_run", stopped_once)
    at.run()
    assert session_of(at.session_state).run is None     # stopped mid-load
    at.run()
    assert not at.exception, at.exception
    assert len(calls) == 2
    got = session_of(at.session_state).run
    assert got.extra["room_run_id"] == store.state(code).run_id
    assert got.result.text == run.result.text
