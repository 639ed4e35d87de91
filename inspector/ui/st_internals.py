"""Every use of a Streamlit internal, in one place. Streamlit has no public API to rerun another session from a
server thread, to know which fragment the script is in, or to tell the toolbar's Stop from a rerun; the room's
watcher (inspector.ui.room_push) and the sidebar's run (inspector.ui.sidebar.stopped_for_good) need all three.
Nothing else in the app names a private attribute of Streamlit (tests/unit/test_layout_rooms.py checks).

`missing()` lists the internals this Streamlit lacks (checked without a running server: the classes, their
methods, and the instance attributes their constructors set); tests/unit/test_st_internals.py fails when the
pinned release (requirements.txt) changes any of them. Where one is missing, `available()` is False and each
caller takes its public fallback: the room's screens poll in a fragment (`st.fragment(run_every=…)`) instead
of being rerun, and a stopped script run is taken for a rerun (the run goes on; the next click keeps it).
"""
from __future__ import annotations

import functools
import inspect
import logging
import time

log = logging.getLogger("llm_inspector")

# (module, class, what the class must have): methods by name, instance attributes as "self.<name>" in __init__.
REQUIRED = (
    ("streamlit.runtime.runtime", "Runtime", ("instance", "exists", "self._session_mgr")),
    ("streamlit.runtime.session_manager", "SessionManager", ("get_active_session_info", "get_session_info")),
    ("streamlit.runtime.app_session", "AppSession",
     ("request_rerun", "has_fragment", "_call_soon_on_event_loop", "self._client_state", "self._scriptrunner")),
    ("streamlit.runtime.scriptrunner.script_runner", "ScriptRunner", ("self._requests",)),
    ("streamlit.runtime.scriptrunner_utils.script_run_context", "ThreadState", ("get",)),
    ("streamlit.runtime.scriptrunner_utils.script_run_context", "FragmentThreadState", ("fragment_id",)),
    ("streamlit.proto.ClientState_pb2", "ClientState", ("CopyFrom", "fragment_id")),
)


def _has(cls, name: str) -> bool:
    if not name.startswith("self."):
        return hasattr(cls, name) or name in getattr(cls, "__dataclass_fields__", {}) or (
            name in {f.name for f in getattr(getattr(cls, "DESCRIPTOR", None), "fields", ())})
    try:
        return f"{name} =" in inspect.getsource(cls.__init__) or f"{name}:" in inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False


@functools.cache
def missing() -> tuple[str, ...]:
    """The internals this Streamlit lacks ("module.Class.name"); empty on the pinned release."""
    import importlib
    gone = []
    for module, cls_name, names in REQUIRED:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            gone.append(f"{module}.{cls_name}")
            continue
        gone += [f"{module}.{cls_name}.{n}" for n in names if not _has(cls, n)]
    if gone:
        log.warning("rooms: this Streamlit lacks %s; students' screens poll instead of being pushed", gone)
    return tuple(gone)


def _runtime():
    """The running server's Runtime, or None (AppTest installs a mock with Runtime's spec, which passes isinstance:
    no server there)."""
    from streamlit.runtime import Runtime
    r = Runtime.instance() if Runtime.exists() else None
    return r if type(r) is Runtime else None


def serving() -> bool:
    """Whether this process is a running Streamlit server (not AppTest, not a bare script)."""
    return _runtime() is not None


def available() -> bool:
    """Whether a server thread can rerun a session here (a running server with the internals in place)."""
    return not missing() and _runtime() is not None


def _session(session_id: str, active: bool = True):
    rt = _runtime()
    if rt is None or missing():
        return None
    mgr = rt._session_mgr
    info = mgr.get_active_session_info(session_id) if active else mgr.get_session_info(session_id)
    return None if info is None else info.session


def fragment_id() -> str | None:
    """The id of the fragment this code runs in; None outside one, or where Streamlit does not say."""
    if missing():
        return None
    from streamlit.runtime.scriptrunner_utils.script_run_context import ThreadState
    try:
        fid = ThreadState.get().fragment_id
    except (AttributeError, RuntimeError):          # no script run on this thread
        return None
    return fid if isinstance(fid, str) and fid else None


def rerun_session(session_id: str, fragment: str | None = None) -> bool:
    """Ask Streamlit to rerun a session as its browser last left it (the whole app, or one fragment of it), as if
    the browser had asked; False when the session is gone (or this Streamlit cannot)."""
    session = _session(session_id)
    if session is None:
        return False
    last = session._client_state
    state = None
    if last is not None:
        state = type(last)()
        state.CopyFrom(last)
        state.fragment_id = fragment if fragment and session.has_fragment(fragment) else ""
    session._call_soon_on_event_loop(lambda: session.request_rerun(state))
    return True


def stopped_for_good(ctx, settle_s: float = 0.2) -> bool:
    """Whether the script run of `ctx` (a ScriptRunContext) that just raised StopException was stopped for good
    (the toolbar's Stop, or the session's end), not for a rerun: a rerun or page change stops the script alike,
    but gives the session a new ScriptRunner's requests just after (hence the settle). False where unknown."""
    if ctx is None or missing():
        return False
    try:
        session = _session(ctx.session_id, active=False)
        if session is None:
            return False
        end = time.monotonic() + settle_s
        while getattr(session._scriptrunner, "_requests", None) is ctx.script_requests and time.monotonic() < end:
            time.sleep(0.02)
        return getattr(session._scriptrunner, "_requests", None) is ctx.script_requests
    except (AttributeError, RuntimeError):
        return False
