"""LLM Inspector: the frame. The sidebar (prompt, Run, the pages, model, settings), then the page.

While the model loads (the first visitors of a fresh server) the frame and the page are drawn at once, the load's
progress under the sidebar's title; the script then waits for the load and draws everything again with the model
(inspector.ui.common.finish_load).

Projector mode (the sidebar's toggle, or ?projector=1 in the URL) makes the type bigger here and every chart
bigger and higher-contrast (inspector.ui.widgets.chart). Rooms (inspector.ui.room): a teacher's screen, followed
by students'."""
import importlib.util  # noqa: E402
import os
import runpy  # noqa: E402

# The thread policy (OpenMP threads that wait spin briefly, then sleep) is engine/threads.py's, one for every entry
# point; it must be in force before torch loads libgomp. Run from its file (found without importing the package, which
# would load torch here, before the page can say it is starting).
runpy.run_path(os.path.join(importlib.util.find_spec("engine").submodule_search_locations[0], "threads.py"))

import sys  # noqa: E402

import streamlit as st  # noqa: E402

# Emoji page icons, never Material Symbols ones: Streamlit makes a page's icon the browser's favicon, and a
# material one is fetched from a public font server by every student's browser (missing without internet).
st.set_page_config(page_title="LLM Inspector", page_icon="🔬", layout="wide")
# The first script run of a fresh server imports the engine and torch (about 4 s): a blank white page until then
# unless something is drawn first. Later runs find them imported and skip this.
_starting = None if "engine" in sys.modules else st.empty()
if _starting is not None:
    _starting.info("Starting LLM Inspector: loading the engine (a few seconds, once after the server starts)…")

from streamlit.runtime.scriptrunner_utils.exceptions import StopException  # noqa: E402

from inspector.session.clients import sessions  # noqa: E402
from inspector.ui import room  # noqa: E402
from inspector.ui.common import admission_key, finish_load, forget_load_box, keep_within_budget, server_limits  # noqa: E402,E501
from inspector.ui.frame import frame  # noqa: E402
from inspector.ui.sidebar import sidebar  # noqa: E402
from inspector.ui.state import session  # noqa: E402
from inspector.ui.turn import own_turn  # noqa: E402
from inspector.ui.widgets import PROJECTOR, projector  # noqa: E402

if _starting is not None:
    _starting.empty()

PAGES = [
    st.Page("pages/overview.py", title="Overview", icon="🏠", default=True),
    st.Page("pages/tokens.py", title="Tokens", icon="🔤"),
    st.Page("pages/attention.py", title="Attention", icon="👀"),
    st.Page("pages/activations.py", title="Activations", icon="📈"),
    st.Page("pages/kv_cache.py", title="KV cache", icon="🧠"),
    st.Page("pages/sampling.py", title="Sampling", icon="🎲"),
    st.Page("pages/timeline.py", title="Timeline", icon="⏱️"),
    st.Page("pages/debugger.py", title="Debugger", icon="🐞"),
    st.Page("pages/compare.py", title="Compare runs", icon="⚖️"),
    st.Page("pages/nan_doctor.py", title="NaN doctor", icon="🩺"),
    st.Page("pages/repetition.py", title="Repetition", icon="🔁"),
    st.Page("pages/explain.py", title="Explain", icon="💡"),
    st.Page("pages/quantization.py", title="Quantization", icon="🗜️"),
    st.Page("pages/trace_files.py", title="Trace files", icon="💾"),
]

# Type for a room: the page's text, metrics and captions larger (charts are restyled by inspector.ui.widgets.chart).
PROJECTOR_CSS = """<style>
[data-testid="stMain"] [data-testid="stMarkdownContainer"] p,
[data-testid="stMain"] [data-testid="stMarkdownContainer"] li { font-size: 1.3rem; line-height: 1.5; }
[data-testid="stMain"] [data-testid="stCaptionContainer"] { font-size: 1.1rem; }
[data-testid="stMain"] [data-testid="stMetricValue"] { font-size: 2.6rem; }
[data-testid="stMain"] [data-testid="stMetricLabel"] p { font-size: 1.15rem; }
[data-testid="stMain"] label p { font-size: 1.1rem; }
[data-testid="stMain"] h1 { font-size: 3rem; } [data-testid="stMain"] h2 { font-size: 2.3rem; }
[data-testid="stMain"] h3 { font-size: 1.9rem; }
</style>"""

state = session()      # this session's SessionState (inspector.ui.state), created on its first script run
if PROJECTOR not in st.session_state:          # a shared link decides the first screen; later, the last choice
    # (a page switch made by the script drops sidebar widget values; SessionState.projector keeps a copy)
    st.session_state[PROJECTOR] = (state.projector if state.projector is not None
                                   else st.query_params.get("projector", "") in ("1", "true", "on", "yes"))
state.projector = bool(st.session_state[PROJECTOR])
nav = st.navigation(PAGES, position="hidden")     # the sidebar lists the pages (inspector.ui.widgets)
limits = server_limits(show_error=False)
too_many = sessions.admit(admission_key(), state.token,   # counts this session for its browser (or, without a
                          limits.max_sessions_per_client, limits.max_sessions)   # cookie, all cookie-less ones)
if too_many:                                      # before any run, room or model is touched: it holds nothing
    st.error(too_many)
    st.stop()
page = nav.url_path or "overview"                 # the page's file name: what a room shows (inspector.ui.room)
forget_load_box()
room.before_page(page)       # a student following a room takes the teacher's run, values and page
sidebar(PAGES)
room.sidebar_panel()
if projector():
    st.html(PROJECTOR_CSS)


def after_page() -> None:
    room.after_page(page)    # a teacher's run and view go to the room
    keep_within_budget()     # what this script just kept (a run, a map) counts now, not at the next rerun


try:
    with own_turn(), frame():   # this session's previous click finishes its page first (inspector.ui.turn.own_turn)
        room.bar()
        nav.run()
except StopException:        # a page that stopped early (st.stop) still shows what it shows to the room
    after_page()
    raise
after_page()
finish_load()    # drawn while the model loaded (a fresh server): its progress until it is there, then all again
