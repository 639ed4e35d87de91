"""A session holds no second copy of an upload, a trace file is bounded by the session's allowance before it is
parsed, and one browser holds a bounded number of sessions (issue 19, items 5 and 6)."""
from __future__ import annotations

import gc

import pytest
from streamlit.runtime.memory_uploaded_file_manager import MemoryUploadedFileManager

from engine import RunSettings
from engine.inspection.trace import to_bytes
from inspector.session.budget import trace_file_limit
from inspector.session.clients import ClientSessions, SessionToken
from inspector.session.limits import Limits
from inspector.session.run import inspect_run
from inspector.ui.state import session_of
from tests.helpers import as_shown

pytestmark = pytest.mark.app


@pytest.fixture(scope="module")
def run(tiny_model):
    return inspect_run(tiny_model, RunSettings(prompt="one two three four", chat=False, max_new_tokens=3))


def test_an_opened_upload_gives_its_bytes_back_and_is_kept_once(page, tiny_model, tiny_model_dir, run, monkeypatch):
    removed = []
    real = MemoryUploadedFileManager.remove_file
    monkeypatch.setattr(MemoryUploadedFileManager, "remove_file",
                        lambda self, sid, fid: removed.append(fid) or real(self, sid, fid))
    at = page("trace_files", run, tiny_model, str(tiny_model_dir)).run()
    at.file_uploader[0].set_value(("ok.trace", to_bytes(run), "application/octet-stream")).run()
    assert not at.exception, at.exception
    assert len(removed) == 1                                      # Streamlit's upload store holds it no more
    assert [u.key for u in at.file_uploader] == ["tf_upload_1"] and at.file_uploader[0].value is None
    name, _, opened = session_of(at.session_state).opened
    assert name == "ok.trace" and opened.result.token_ids == run.result.token_ids
    at.button(key="tf_open").click().run()
    held = session_of(at.session_state)
    assert held.run is opened and held.opened is None                                  # one copy: the run


def test_a_trace_over_half_the_sessions_allowance_is_refused_before_parsing(page, tiny_model, tiny_model_dir, run,
                                                                             monkeypatch):
    import engine.inspection.trace
    monkeypatch.setenv("LLM_INSPECTOR_MAX_SESSION_MB", "1")
    data = to_bytes(run)
    most = trace_file_limit(Limits(max_session_mb=1))
    assert len(data) > most                                       # 3 steps of logits: ~0.6 MB against 0.4
    parsed = []
    monkeypatch.setattr(engine.inspection.trace, "from_bytes", lambda *a, **k: parsed.append(1))
    at = page("trace_files", run, tiny_model, str(tiny_model_dir)).run()
    at.file_uploader[0].set_value(("big.trace", data, "application/octet-stream")).run()
    assert not at.exception, at.exception
    (err,) = at.error
    assert as_shown(err.value).startswith(f"Could not open big.trace: the file is {len(data) / 2**20:,.1f} MiB; "
                                          f"this server opens trace files of at most {most / 2**20:,.1f} MiB")
    assert parsed == [] and session_of(at.session_state).run is run


def test_a_browser_holds_at_most_its_share_of_sessions():
    reg = ClientSessions()
    tabs = [SessionToken() for _ in range(3)]
    assert [reg.admit("browser:a", t, 2) for t in tabs[:2]] == [None, None]
    refused = reg.admit("browser:a", tabs[2], 2)
    assert refused.startswith("This browser already has 2 sessions open on this server") and reg.live("browser:a") == 2
    assert reg.admit("browser:a", tabs[0], 2) is None                # a counted session's reruns go on
    assert reg.admit("browser:b", SessionToken(), 2) is None         # another browser is not affected
    del tabs[0]                                                       # that tab's session ended and was dropped
    gc.collect()
    assert reg.live("browser:a") == 1
    assert reg.admit("browser:a", tabs[1], 2) is None                 # the refused tab, tried again, gets in
    assert reg.admit("browser:a", SessionToken(), 2) is not None and reg.live("browser:a") == 2


def test_the_app_stops_a_session_past_the_cap_before_anything_else(monkeypatch, app_file, tiny_model_dir):
    from streamlit.runtime.pages_manager import PagesManager
    from streamlit.testing.v1 import AppTest

    import inspector.session.clients as clients
    import inspector.ui.common
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("LLM_INSPECTOR_MAX_SESSIONS_PER_CLIENT", "2")
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)
    monkeypatch.setattr(clients, "sessions", ClientSessions())
    monkeypatch.setattr(inspector.ui.common, "browser_key", lambda: "browser:one")
    tabs = [AppTest.from_file(str(app_file), default_timeout=120).run() for _ in range(3)]
    assert [bool(t.error) for t in tabs] == [False, False, True]
    assert as_shown(tabs[2].error[0].value).startswith("This browser already has 2 sessions open on this server")
    assert session_of(tabs[2].session_state).run is None and not tabs[2].sidebar.text_area   # nothing held
    tabs[0].run()
    assert not tabs[0].error                                          # the admitted tabs go on
