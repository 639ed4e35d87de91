"""Quantization: how much each GGUF format (Q8_0, Q5_x, Q4_x) damages each stage of the current run, layer by
layer, and the next-token distributions step by step (pages.prescriptions.quantization_section)."""
import streamlit as st

from pages.common import require_run_and_model
from pages.prescriptions import quantization_section

st.header("Quantization")
run, model = require_run_and_model("quantize its weights")
quantization_section(run, model)
