"""Quantization: how much each GGUF format (Q8_0, Q5_x, Q4_x) damages each stage of the current run, layer by
layer, and the next-token distributions step by step (inspector.ui.prescriptions.quantization_section); a GGUF file as
stored against its dequantised self (inspector.ui.stored_panel.stored_section); then the scoreboard in llama.cpp's
terms over a set of texts (inspector.ui.scoreboard.scoreboard_section)."""
import streamlit as st

from inspector.ui.common import require_run_and_model
from inspector.ui.frame import ensure_frame
from inspector.ui.prescriptions import quantization_section
from inspector.ui.scoreboard import scoreboard_section
from inspector.ui.stored_panel import stored_section

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

st.header("Quantization")
run, model = require_run_and_model("quantize its weights")
quantization_section(run, model)
stored_section(run, model)
scoreboard_section(model)
