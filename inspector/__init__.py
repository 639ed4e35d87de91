"""Turns what the engine's probes captured into pandas tables and plotly figures (no Streamlit here)."""
