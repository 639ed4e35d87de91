"""Timeline: where the run's time went, by phase and step, and per layer when timing marks were recorded."""
import streamlit as st

from inspector.ui.common import get_model, require_run
from inspector.ui.frame import ensure_frame
from inspector.ui.widgets import chart, columns, metric_columns
from inspector.views import timeline as tl

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

st.header("Timeline")
run = require_run()
model = get_model()
result = run.result
device_type = model.device.type if model is not None and model.name == run.model_name else "cpu"

steps = tl.step_table(result)
c = metric_columns(4)
c[0].metric("Run", f"{1e3 * run.seconds:,.0f} ms")
c[1].metric("Tokenize", f"{1e3 * result.timings['tokenize']:,.1f} ms")
c[2].metric("Prefill", f"{1e3 * result.timings['prefill']:,.1f} ms", f"{run.n_prompt} positions", delta_color="off")
c[3].metric("Decode per token", f"{1e3 * result.timings['per_token_decode']:,.1f} ms",
            f"{max(0, len(result.steps) - 1)} steps", delta_color="off")

st.subheader("Phases, end to end")
st.caption("tokenize, then per step: forward (step 0 is the prefill), sample (the sampler chain and the draw), "
           "detokenize. Host clocks (time.perf_counter) around each phase; the forward's time ends with the "
           "logits copied to the CPU, so on a GPU it includes the wait for the kernels.")
chart(tl.gantt_figure(tl.phase_table(result)), key="tl_gantt")
c1, c2 = columns([3, 2])
log_y = c1.toggle("Log scale (the prefill often dwarfs the decode steps)", value=False, key="tl_log")
with c1:
    chart(tl.stacked_figure(steps, log_y=log_y), key="tl_stacked")
c2.dataframe(tl.totals_table(result), hide_index=True, key="tl_totals",
             column_config={"ms": st.column_config.NumberColumn(format="%.2f"),
                            "share_pct": st.column_config.NumberColumn("share %", format="%.1f")})

st.subheader("Per step")
st.dataframe(steps, hide_index=True, key="tl_steps",
             column_config={k: st.column_config.NumberColumn(format="%.3f")
                            for k in ("forward_ms", "sample_ms", "detokenize_ms", "total_ms")})

st.subheader("Per layer")
st.caption(tl.timing_note(device_type))
if not run.recording.marks:
    st.info("This run recorded no timing marks (the probe's timing was off).")
    st.stop()
durations = tl.layer_durations(run.recording.marks)
with_prefill = st.toggle("Include the prefill (step 0) in the heatmap", value=len(result.steps) == 1,
                         key="tl_heat_prefill")
chart(tl.layer_heatmap(durations, include_prefill=with_prefill), key="tl_heatmap")
means = tl.stage_means(durations)
chart(tl.stage_means_figure(means), key="tl_means")
with st.expander("Durations per step and stage"):
    st.dataframe(durations, hide_index=True, key="tl_durations")
