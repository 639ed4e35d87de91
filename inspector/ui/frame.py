"""app.py runs every page inside frame(); a page opened by URL on a fresh server (Streamlit's pages/ folder
detection) switches to app.py's navigation so the sidebar is there."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import streamlit as st
from streamlit.runtime.pages_manager import PagesManager

from inspector.ui.state import session

_IN_FRAME: ContextVar[bool] = ContextVar("llm_inspector_in_frame", default=False)


@contextmanager
def frame():
    """app.py runs the chosen page inside this, so a page can tell it has the sidebar around it."""
    token = _IN_FRAME.set(True)
    try:
        for problem in unsafe_settings():
            st.warning(f"Unsafe server setting: {problem}. See docs/CLASSROOM.md, or start with scripts/serve.sh.",
                       icon="⚠️")
        yield
    finally:
        _IN_FRAME.reset(token)


def ensure_frame() -> None:
    """Streamlit treats a folder named pages/ beside app.py as an old-style multipage app until app.py's
    st.navigation runs: on a freshly started server, the first request for a page URL runs that page alone,
    without the sidebar. A page that finds itself outside app.py switches Streamlit to app.py's
    navigation and reruns once, which brings the sidebar back on the same URL. Each page calls it once, at its
    top (tests/unit/test_layout.py checks it)."""
    if _IN_FRAME.get():
        return
    PagesManager.uses_pages_directory = False
    ss = session()
    if not ss.frame_rerun:
        ss.frame_rerun = True
        st.rerun()


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def unsafe_settings() -> list[str]:
    """What in this server's Streamlit settings exposes it more than a classroom should."""
    problems = []
    address = (st.get_option("server.address") or "").strip()
    listens_widely = address not in LOOPBACK
    if listens_widely:
        if not st.get_option("server.enableXsrfProtection"):
            problems.append("XSRF protection is off while the app listens beyond this computer")
        if not st.get_option("server.enableCORS"):
            problems.append("CORS protection is off while the app listens beyond this computer")
        if not st.get_option("server.allowedHosts"):
            problems.append("no allowed host names (server.allowedHosts): open to DNS rebinding")
    if st.get_option("client.showErrorDetails") in ("full", True, "stacktrace"):
        problems.append("full error details (stack traces with server paths) are shown to every browser")
    return problems
