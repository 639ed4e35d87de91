"""Issue 31, item 1: the Streamlit internals the rooms and the sidebar's Stop rest on are in one adapter
(inspector.ui.st_internals). On the pinned Streamlit every one of them is there, with the shape the adapter uses;
a release that changes any fails here, not silently in a classroom. Without them, the adapter says so and each
caller takes its public fallback."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import streamlit

from inspector.ui import room_push, st_internals

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_the_pinned_streamlit_is_the_one_installed_and_has_every_internal_the_adapter_uses():
    pinned = re.search(r"^streamlit==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert streamlit.__version__ == pinned
    st_internals.missing.cache_clear()
    assert st_internals.missing() == ()


def test_the_internals_have_the_shape_the_adapter_calls():
    from streamlit.proto.ClientState_pb2 import ClientState
    from streamlit.runtime.app_session import AppSession
    from streamlit.runtime.scriptrunner_utils.script_run_context import ScriptRunContext
    from streamlit.runtime.session_manager import ActiveSessionInfo, SessionInfo, SessionManager
    assert list(inspect.signature(AppSession.request_rerun).parameters) == ["self", "client_state"]
    assert list(inspect.signature(AppSession.has_fragment).parameters) == ["self", "fragment_id"]
    assert len(inspect.signature(AppSession._call_soon_on_event_loop).parameters) == 2     # self, a callable
    for name in ("get_active_session_info", "get_session_info"):
        assert list(inspect.signature(getattr(SessionManager, name)).parameters) == ["self", "session_id"]
    assert "session" in {f for f in getattr(SessionInfo, "__dataclass_fields__", {})} | set(
        inspect.signature(SessionInfo).parameters)
    assert issubclass(ActiveSessionInfo, object)
    assert {"session_id", "script_requests"} <= set(ScriptRunContext.__dataclass_fields__)
    state = ClientState()
    state.fragment_id = "f"
    copy = ClientState()
    copy.CopyFrom(state)
    assert copy.fragment_id == "f"


def test_without_the_internals_the_rooms_poll_and_a_stop_is_taken_for_a_rerun(monkeypatch):
    monkeypatch.setattr(st_internals, "missing", lambda: ("streamlit.runtime.app_session.AppSession.request_rerun",))
    assert not st_internals.available() and not room_push.available()        # the room's fragments poll
    assert st_internals.rerun_session("any-session") is False
    assert st_internals.fragment_id() is None

    class Ctx:
        session_id, script_requests = "any-session", object()
    assert st_internals.stopped_for_good(Ctx()) is False


def test_outside_a_running_server_nothing_is_pushed():
    assert not st_internals.available()                                      # no Runtime in a unit test
    assert st_internals.rerun_session("nobody") is False
    assert st_internals.stopped_for_good(None) is False
