"""NaN/Inf doctor: where the current run first went non-finite (from its recorded statistics), teaching
presets that reproduce real failures (re-running the run's prompt with a fault), and fp32 vs float16 /
bfloat16 relative error per stage. Model work happens only on a button press and is kept in the session."""
import streamlit as st

from engine.generate import nonfinite_stop
from engine.inspection.nonfinite import locate_nonfinite
from engine.progress import tell_units
from engine.tools.doctor import PRESETS, precision_compare, run_doctor
from inspector.session.memo import run_key
from inspector.session.models import shared_copy
from inspector.session.run import check_settings
from inspector.ui.common import get_model, on_demand, plain, require_run, server_limits, was_stopped
from inspector.ui.demos import lesson
from inspector.ui.frame import ensure_frame
from inspector.ui.prescriptions import rescue_section
from inspector.ui.state import session
from inspector.ui.widgets import chart, checked, checked_float
from inspector.views import doctor as dv

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

MAX_PRECISION_POSITIONS = 256
MAX_POSITION = 10**9          # a weight's element index can be large; an activation's position is checked by run_doctor
MAX_FACTOR = 1e30             # a scale fault's factor (float32 overflows past 3.4e38 anyway)


def low_precision_copy(model, key: tuple, dtype: str):
    """The shared model's weights converted to dtype: one copy per process, counted against max_models
    (inspector.session.models.shared_copy), never the shared model itself."""
    return shared_copy(model, dtype)


def show_nonfinite(nf, recording, key: str, fp16: bool, specs=()) -> None:
    st.error(dv.nonfinite_headline(nf))
    prof = dv.profile_frame(recording, nf.step, nf.position)
    found = dv.fault_outcome(specs, nf, prof, fp16=fp16)
    if found:
        st.markdown(found)
    c = st.columns(4)
    for col, (label, value) in zip(c, [("Step", nf.step), ("Stage", nf.stage_in_layer),
                                       ("Layer", "—" if nf.layer is None else nf.layer), ("Position", nf.position)]):
        col.metric(label, value)
    chart(dv.profile_figure(prof, nf.stage, fp16_line=fp16), key=f"{key}_profile")
    st.caption("Largest magnitude of every stage at this position, in forward order, around the first NaN/Inf "
               "(double-click the chart for the whole forward). Red crosses: stages holding a NaN; orange triangles: "
               "stages holding an Inf and no NaN. The table: the stages leading up to the first one (marked ◀), "
               "and the two after it: min and max leave NaN out, mean and std leave NaN and Inf out (NaN where "
               "nothing is left); nan and inf count the elements.")
    lead = dv.lead_up_frame(prof, nf.stage)
    st.dataframe(lead, key=f"{key}_leadup", hide_index=True, height=38 * (len(lead) + 1),
                 column_config={"where": st.column_config.TextColumn("", width="medium")})


def show_stop(result) -> None:
    """The run's stop reason, said plainly when the logits went non-finite."""
    b = nonfinite_stop(result)
    if b:
        held = "NaN or Inf" if b["nan"] is None else f"{b['nan']:,} NaN and {b['inf']:,} Inf"
        st.error(f"Stop reason **non-finite logits**: at step {b['step']} (position {b['position']}) the logits held "
                 f"{held} values. Nothing was sampled from them: the run ends there with "
                 f"{len(result.token_ids)} tokens.")


st.header("NaN / Inf doctor")
run = require_run()
lesson("nan_doctor")          # after a demo that opens this page: its lesson on the first screen
res = run.result

st.subheader("This run")
nf = locate_nonfinite(run.recording)
show_stop(res)
if nf is None:
    n_records = sum(len(b.names) for b in run.recording.stats)
    st.success(f"Every stage stayed finite at every step of this run ({n_records:,} "
               "stage records checked).")
else:
    show_nonfinite(nf, run.recording, "nd_run", fp16=True, specs=run.extra.get("injections") or ())

model = get_model()
if model is None or model.name != run.model_name:
    st.warning(f"This run was made with **{plain(run.model_name)}**; choose that model in the sidebar to inject faults "
               "or compare precisions.")
    st.stop()
mkey = (model.name, id(model))

st.subheader("Fault injection")
st.caption("Re-runs this run's prompt (same tokens and sampling settings) with a fault, recording statistics of "
           "every stage, and stops at the first step that produced a NaN or Inf.")
preset = st.selectbox("Preset", [*PRESETS, "custom"], key="nd_preset", format_func=dv.preset_label)
if preset == "custom":
    c1, c2, c3, c4 = st.columns(4)
    kind = c1.selectbox("Fault", ["nan", "inf", "zero", "scale"], key="nd_kind")
    choices = dv.target_choices(model.config)
    target = c2.selectbox("Stage or weight", choices, key="nd_target",
                          index=choices.index("mlp.act" if "mlp.act" in choices else "mlp_out"))
    last = model.config.num_layers - 1
    layer = checked(c3.number_input("Layer", 0, last, 0, key="nd_layer"), 0, last, "Layer")
    pos = checked(c4.number_input("Position (−1: every; weights: element)", -1, MAX_POSITION, 0, key="nd_pos"), -1,
                  MAX_POSITION, "Position")
    c5, c6, c7 = st.columns(3)
    factor = checked_float(c5.number_input("Scale factor", -MAX_FACTOR, MAX_FACTOR, 1000.0, key="nd_factor",
                                           disabled=kind != "scale"), -MAX_FACTOR, MAX_FACTOR, "Scale factor")
    dtype = c6.selectbox("Dtype", ["as loaded", "float16", "bfloat16"], key="nd_dtype")
    eps0 = c7.checkbox("RMSNorm epsilon 0", key="nd_eps0")
    specs = [dv.injection_spec(kind, target, int(layer), None if pos < 0 else int(pos), float(factor))]
    norm_eps = 0.0 if eps0 else None
    dtype = None if dtype == "as loaded" else dtype
else:
    p = PRESETS[preset]
    specs, norm_eps, dtype = list(p.injections), p.norm_eps, p.dtype
st.caption(f"Faults: `{' '.join(specs)}`" + (f" · dtype {dtype}" if dtype else "")
           + (f" · RMSNorm ε = {norm_eps}" if norm_eps is not None else ""))
limits = server_limits(show_error=False)
default_new = run.settings.max_new_tokens      # a reopened trace's: any value its file holds
default_new = min(8, default_new, limits.max_new_tokens) if type(default_new) is int and default_new >= 1 else 8
max_new = checked(st.number_input("Max new tokens", 1, limits.max_new_tokens, default_new, key="nd_max_new"), 1,
                  limits.max_new_tokens, "Max new tokens")
reports = session().memo("nd_reports")                         # run_key -> the last fault run on it
autorun, session().autorun = session().autorun, False          # a demo asked for the fault run
fault_key, fault_what = (run_key(run), tuple(specs), norm_eps, dtype, int(max_new)), "the fault run"
if st.button("Run with the fault", key="nd_inject", type="primary") or autorun or was_stopped(fault_what, fault_key):
    text = st.empty()

    def fault_run(tell):    # the one progress protocol: a unit per token, a Stop lands between two tokens
        s = check_settings(model, run.settings, limits).settings        # a reopened trace's prompt is checked too
        same = dtype in (None, str(model.dtype).removeprefix("torch."))
        tell_units(tell, 0, int(max_new), "the prompt" if same else f"a {dtype} copy of the weights (once per server)")
        pieces: list[str] = []

        def on_token(step) -> None:
            pieces.append(step.text)
            text.code("".join(pieces), language=None, wrap_lines=True)
            tell_units(tell, step.index + 1, int(max_new), f"token {step.index + 2} of at most {max_new}")
        report = run_doctor(model if same else low_precision_copy(model, mkey, dtype), s.prompt, injections=specs,
                            norm_eps=norm_eps, on_token=on_token,
                            **{**s.generation_kwargs(), "max_new_tokens": int(max_new)})
        tell_units(tell, int(max_new), int(max_new), "done")
        return report
    # a fresh store: the button always reruns; the page keeps the run's last fault run in reports
    if (computed := on_demand({}, fault_key, fault_what, fault_run, stop_on_error=False)) is not None:
        reports[run_key(run)] = computed
    text.empty()
report = reports.get(run_key(run))
if report is not None:
    st.markdown(f"`{', '.join(report.injections) or 'no fault'}` ({report.dtype}"
                + (f", RMSNorm ε {report.norm_eps}" if report.norm_eps is not None else "") + f") · stop: "
                f"**{plain(report.result.stop_reason)}**" + (f" · {plain(report.error)}" if report.error else ""))
    show_stop(report.result)
    for note in report.notes:           # an override on a matrix kept quantised worked on its dequantised values
        st.warning(plain(note))
    if report.first_nonfinite is None:
        st.success("The fault produced no NaN or Inf: every stage stayed finite.")
    else:
        show_nonfinite(report.first_nonfinite, report.probe.recording, "nd_fault", fp16=report.dtype == "float16",
                       specs=report.injections)
    st.code(report.result.text or "(nothing)", language=None, wrap_lines=True)

st.subheader("Precision: fp32 vs float16 / bfloat16")
st.caption("The run's tokens through this model and through a lower-precision copy; each runs on its own "
           "activations, so the error shown is the accumulated one (‖low − ref‖ / ‖ref‖ over all positions).")
c1, c2 = st.columns(2)
low_dtype = c1.selectbox("Compare with", ["float16", "bfloat16"], key="nd_prec_dtype")
thr = checked_float(c2.number_input("Divergence threshold (relative error; 0 = 8 × unit roundoff)", 0.0, 10.0, 0.0,
                                    format="%.4f", key="nd_prec_thr"), 0.0, 10.0, "Divergence threshold")
precs = session().memo("nd_precs")                             # run_key -> the last comparison
prec_key, prec_what = (run_key(run), low_dtype, thr), "the precision comparison"
if st.button("Compare precisions", key="nd_prec_run") or was_stopped(prec_what, prec_key):
    ids = run.ids[:MAX_PRECISION_POSITIONS]

    def compare(tell):      # the low copy first (once per server), then both forwards layer by layer
        return precision_compare(model, low_precision_copy(model, mkey, low_dtype), ids, threshold=thr or None,
                                 on_progress=tell)
    # a fresh store: the button always recomputes; the page keeps the run's last comparison in precs
    if (computed := on_demand({}, prec_key, prec_what, compare, stop_on_error=False)) is not None:
        precs[run_key(run)] = computed
prec = precs.get(run_key(run))
if prec is not None:
    df = dv.precision_frame(prec)
    d = prec.divergence
    worst = df.loc[df["rel_err"].idxmax()]
    msg = (f"{prec.dtype}: divergence begins at **`{d['stage']}`** (relative error {d['rel_err']:.3g} > "
           f"{prec.threshold:.3g})" if d else f"{prec.dtype}: no stage exceeds relative error {prec.threshold:.3g}")
    st.markdown(msg + f" · largest error {worst['rel_err']:.3g} at `{worst['stage']}` · top-1 prediction agreement "
                f"{prec.top1_agreement:.1%}")
    chart(dv.precision_figure(df, prec.threshold, d), key="nd_prec_line")
    chart(dv.precision_heatmap(df), key="nd_prec_heat")
    st.dataframe(df.drop(columns=["order"]), key="nd_prec_table", hide_index=True)

rescue_section(run, model)
