"""LLM Inspector: the frame. Sidebar (model, prompt, settings, Run) and navigation between the pages."""
import streamlit as st

from pages.frame import frame
from pages.sidebar import sidebar

st.set_page_config(page_title="LLM Inspector", page_icon=":material/biotech:", layout="wide")

PAGES = [
    st.Page("pages/overview.py", title="Overview", icon=":material/home:", default=True),
    st.Page("pages/tokens.py", title="Tokens", icon=":material/text_fields:"),
    st.Page("pages/attention.py", title="Attention", icon=":material/visibility:"),
    st.Page("pages/activations.py", title="Activations", icon=":material/monitoring:"),
    st.Page("pages/kv_cache.py", title="KV cache", icon=":material/memory:"),
    st.Page("pages/sampling.py", title="Sampling", icon=":material/casino:"),
    st.Page("pages/timeline.py", title="Timeline", icon=":material/timer:"),
    st.Page("pages/debugger.py", title="Debugger", icon=":material/bug_report:"),
    st.Page("pages/compare.py", title="Compare runs", icon=":material/compare_arrows:"),
    st.Page("pages/nan_doctor.py", title="NaN doctor", icon=":material/healing:"),
    st.Page("pages/repetition.py", title="Repetition", icon=":material/repeat:"),
    st.Page("pages/trace_files.py", title="Trace files", icon=":material/save:"),
]

nav = st.navigation(PAGES)
sidebar()
with frame():
    nav.run()
