"""The Quantization page's GGUF file as stored against its dequantised self (engine.tools.quant_stored): the sidebar's
GGUF file loaded both ways (shared, like the sidebar's model), the current run's prompt and settings, every stage's
difference and the next-token distributions step by step, judged against the stated tolerance."""
from __future__ import annotations

import dataclasses

import streamlit as st

from engine import InputError
from engine.tools.quant_stored import TOLERANCE, stored_report
from inspector.session.memo import run_key
from inspector.session.model_choices import is_gguf
from inspector.session.models import label, shared_model
from inspector.session.run import check_settings
from inspector.ui.common import chosen_source, on_demand, plain, server_limits, was_stopped
from inspector.ui.state import session
from inspector.ui.widgets import chart
from inspector.views import stored as sv

MAX_STORED_TOKENS = 32        # generated twice (each side on its own), then one forward each over every position


def stored_section(run, model) -> None:
    st.subheader("The file as stored vs its dequantised self")
    source = chosen_source()
    if not is_gguf(source):
        st.info("The sidebar's model is not a GGUF file: there are no stored blocks to compare with their "
                "dequantised values. Choose a .gguf model (the bundled one is) to compare.")
        return
    st.caption(f"{plain(label(source))} loaded twice: as stored (its matrices kept in the file's blocks, multiplied "
               "by them on the CPU in float32) and dequantised to float32. The dequantised model generates from this "
               f"run's prompt and settings (at most {MAX_STORED_TOKENS} tokens, as many as the run generated), both "
               "read those tokens, and every stage is compared: max |Δ| and relative L2 ||stored − dequantised|| / "
               "||dequantised|| over the run and at each step, and per step KL(p_dequantised || p_stored). Both "
               "compute with the file's own values, so only float32 summation order differs: the stated tolerance "
               f"is relative L2 {TOLERANCE:g}; a stage above it means the two paths do not compute the same thing.")
    try:
        settings = check_settings(model, run.settings, server_limits(show_error=False)).settings
    except InputError as e:
        st.error(f"This run's settings cannot be generated again on this server: {plain(e)}")
        return
    n = max(1, min(MAX_STORED_TOKENS, len(run.result.token_ids)))
    settings = dataclasses.replace(settings, max_new_tokens=n)
    store = session().memo("qz_stored")
    key, what = (*run_key(run), source, n), "the stored vs dequantised comparison"

    def compute(progress):
        stored = shared_model(source, "cpu", "float32", quant="stored")
        dequant = shared_model(source, "cpu", "float32")
        return stored_report(stored, dequant, settings, on_progress=progress)
    if st.button("Compare as stored vs dequantised", key="qz_stored_run") or was_stopped(what, key):
        on_demand(store, key, what, compute, stop_on_error=False, max_entries=4)
    report = store.get(key)
    if report is not None:
        show_stored(report)


def show_stored(report) -> None:
    m = st.columns(4)
    m[0].metric("Logits max |Δ|", f"{report.logits_max_abs:.3g}")
    m[1].metric("KL mean (nats)", f"{report.kl_mean:.3g}")
    m[2].metric("Same top token", f"{report.same_top:.0%}")
    m[3].metric("First stage over the tolerance", report.first_stage_over or "none")
    own = report.own_first_divergence
    st.caption(f"{plain(report.stored)} against {plain(report.dequantized)}: {report.positions} positions, "
               f"{report.steps} steps; weights {sum(report.stored_bytes.values()):,} bytes as stored, "
               f"{sum(report.dequantized_bytes.values()):,} dequantised. Generating on its own, the stored model "
               + ("writes the same tokens." if own is None else f"writes other tokens from step {own}."))
    chart(sv.stored_stage_figure(report), key="qz_stored_fig")
    chart(sv.stored_steps_heatmap(report), key="qz_stored_heat")
    st.dataframe(sv.stored_stage_frame(report).drop(columns=["order"]), key="qz_stored_table", hide_index=True,
                 column_config={c: st.column_config.NumberColumn(format="%.3e") for c in ("max_abs_diff", "rel_l2")})
    st.dataframe(sv.stored_steps_frame(report), key="qz_stored_steps", hide_index=True)
