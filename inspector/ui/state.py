"""The one place the app keeps its own per-session state in st.session_state: one typed SessionState
(inspector.session.state) under KEY, created on a session's first use (Streamlit's `if key not in
st.session_state`). Widget values stay under their widget keys; nothing else is kept there."""
from __future__ import annotations

from collections.abc import MutableMapping

import streamlit as st

from inspector.session.state import SessionState

KEY = "_session"


def session_of(state: MutableMapping) -> SessionState:
    """The SessionState held in a session's state mapping (st.session_state, or an AppTest's), created there on
    first use."""
    if KEY not in state:
        state[KEY] = SessionState()
    return state[KEY]


def session() -> SessionState:
    """This browser session's SessionState."""
    return session_of(st.session_state)

