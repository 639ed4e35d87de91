"""LLM Inspector: the frame. Sidebar (model, prompt, settings, Run) and navigation between the pages."""
import streamlit as st

from pages.common import sidebar

st.set_page_config(page_title="LLM Inspector", page_icon="🔬", layout="wide")

PAGES = [
    st.Page("pages/overview.py", title="Overview", icon="🏠", default=True),
    st.Page("pages/tokens.py", title="Tokens", icon="🔤"),
    st.Page("pages/attention.py", title="Attention", icon="👀"),
    st.Page("pages/activations.py", title="Activations", icon="📈"),
    st.Page("pages/kv_cache.py", title="KV cache", icon="🗄️"),
    st.Page("pages/sampling.py", title="Sampling", icon="🎲"),
    st.Page("pages/timeline.py", title="Timeline", icon="⏱️"),
]

nav = st.navigation(PAGES)
sidebar()
nav.run()
