"""Sections for the prescribing doctors, called from the pages: why the run loops (Repetition page), the
fp32 rescue set (NaN doctor page) and quantization damage per stage (the Quantization page).

Each takes the current run (engine.Trace) and the model it was made with. Model work happens only on a
button press, inside a device slot with a progress bar and a Stop button (inspector.ui.common.on_demand: a stopped
search shows "Stopped" and keeps nothing), and is kept in this session keyed by the run and the choices that
change the result; display-only controls never re-run the model.
"""
from __future__ import annotations

import streamlit as st
import torch

from engine import InputError
from engine.cli.prescribe import check_command
from engine.inspection.loops import MIN_COUNT, MIN_TOKENS, has_loop
from engine.tools.doctor import PRESETS
from engine.tools.quant import FORMATS, THRESHOLD, compare_formats
from engine.tools.rescue import MAX_NEW_TOKENS, find_rescue
from engine.tools.why_loop import LOOK_FURTHER, MAX_RERUNS, why_loop
from engine.variants import cast_model
from inspector.session.memo import run_key
from inspector.session.run import check_settings
from inspector.ui.common import on_demand, plain, server_limits, was_stopped
from inspector.ui.state import session
from inspector.ui.widgets import chart, checked, checked_text
from inspector.views import prescribe as pv

MAX_QUANT_POSITIONS = 256
MAX_RESCUE_TOKENS = 16
MAX_INJECT_CHARS = 1_000      # a few KIND@STAGE[:N] specs; parsed (and matched against every stage) per rerun
QUANT_CHOICES = (*FORMATS, "F16", "BF16", "F32")


def _reference_note(model) -> None:
    if model.dtype != torch.float32:
        st.caption(f"The model is loaded in {str(model.dtype).removeprefix('torch.')}: its weights upcast to "
                   "float32 serve as the fp32 reference here, not the original float32 weights.")


def _checked_settings(run, model):
    """The run's settings as this server would accept them for a new generation (inspector.session.run.
    check_settings: the prompt's characters and tokens, new tokens, stop strings), or None after the message.
    A reopened trace's settings are whatever its file holds: a section that reruns them checks them first."""
    try:
        return check_settings(model, run.settings, server_limits(show_error=False)).settings
    except InputError as e:
        st.error(f"This run's settings cannot be generated again on this server: {plain(e)}")
        return None


def _compute(store: dict, key, what: str, compute) -> None:
    """compute(on_progress) in a device slot with a progress bar and Stop (inspector.ui.common.on_demand), kept in
    store; an engine error is shown and the rest of the page still drawn."""
    on_demand(store, key, what, compute, stop_on_error=False, max_entries=4)


# ---- Repetition page ------------------------------------------------------------------------------
def why_loop_section(run, model) -> None:
    st.subheader("Why does it loop?")
    n = len(run.result.token_ids)
    looping = has_loop(run.result.token_ids)
    st.caption(f"Diagnoses this run's loop (a loop: the same tokens at least {MIN_COUNT} full times, {MIN_TOKENS} "
               "tokens or more, to the end of the run): reruns its prompt and seed for its own length, then tests each "
               "candidate cause by removing it and rerunning: the copy heads (the top 1, 2, 4, 8 zeroed, fewest "
               "first), the sampler (each penalty, no-repeat n-gram and temperature, weakest first), the numerics "
               "(another dtype) and the prompt (each span left out). A cause counts only with its rerun, continued "
               "past the run's length by twice the loop's span: the loop is gone when the rerun holds no loop and no "
               "repeat heading into one (two copies or more) there; it is delayed when the loop comes back after "
               "the run's length; a rerun that ends its text within the length has only stopped.")
    further = None
    if not looping:
        st.info(f"This run's {n} generated tokens hold no loop: there is nothing to diagnose. You can look further: "
                f"rerun the same prompt and seed for up to {LOOK_FURTHER} tokens and diagnose a loop there.")
        further = LOOK_FURTHER
    budget = checked(st.number_input("Most reruns", 5, MAX_RERUNS, MAX_RERUNS, key="wl_budget"), 5, MAX_RERUNS,
                     "Most reruns")
    store = session().memo("wl_reports")
    key = (*run_key(run), budget)
    what = "the loop diagnosis"
    label = "Find the cause" if looping else f"Look further ({LOOK_FURTHER} tokens)"
    if (st.button(label, key="wl_run", type="primary") or was_stopped(what, key)) \
            and (settings := _checked_settings(run, model)):
        _compute(store, key, what, lambda tell: why_loop(model, settings, look_further=further, max_reruns=budget,
                                                         on_progress=tell))
    report = store.get(key)
    if report is not None:
        show_why_loop(report)


def show_why_loop(report) -> None:
    if report.status == "no loop":
        st.success(f"{report.headline} ({report.reruns} rerun{'s' if report.reruns != 1 else ''})")
        return
    gone = [c for c in report.causes if c.loop_gone]
    st.warning(report.headline)
    c = st.columns(3)
    c[0].metric("Reruns", f"{report.reruns} / {report.max_reruns}")
    c[1].metric("Changes that break the loop", len(gone),
                help=f"{sum(c.outcome == 'loop delayed' for c in report.causes)} more only delay it")
    c[2].metric("Top copy head", f"L{report.copy_heads[0]['layer']} h{report.copy_heads[0]['head']}"
                if report.copy_heads else "—")
    st.dataframe(pv.causes_frame(report), key="wl_causes", hide_index=True)
    chart(pv.causes_figure(report), key="wl_causes_fig")
    st.caption(f"Each bar is one rerun: how many tokens it generated before its loop came back or its text ended. "
               f"A green bar: no loop and no repeat heading into one past your run's {report.horizon} tokens (each "
               f"rerun runs up to {report.rerun_horizon}). An orange bar: loop-free for your run's length, then the "
               "loop came back: delayed, not fixed. A grey bar: the rerun ended its text (end-of-text) within the "
               "length, with no loop before it: it stopped, which is not a fix.")
    for c in (c for c in report.causes if c.outcome == "loop delayed"):
        st.markdown(f"**{plain(c.change)}** — {plain(c.verdict)}:")
        st.code(c.text_after, language=None, wrap_lines=True)
    if report.copy_heads:
        st.markdown("**Copy heads** (mean attention from the looping tokens to their copy one period back)")
        st.dataframe(pv.copy_heads_frame(report), key="wl_heads", hide_index=True)
    for s in report.skipped:
        st.info(f"Not tried: {s}")


# ---- NaN doctor page ------------------------------------------------------------------------------
def _rescue_choices() -> tuple[list[str], float | None, str]:
    """The section's fault picker: (injection specs, RMSNorm epsilon, low dtype)."""
    c1, c2, c3 = st.columns([2, 2, 1])
    preset = c1.selectbox("Fault", ["fp16-overflow", *[p for p in PRESETS if p != "fp16-overflow"], "none",
                                    "custom"], key="rs_preset")
    custom = checked_text(c2.text_input("Injections (KIND@STAGE[:N], comma-separated)", "scale=1e6@blocks.5.mlp_out",
                                        key="rs_inject", disabled=preset != "custom", max_chars=MAX_INJECT_CHARS),
                          MAX_INJECT_CHARS, "Injections")
    dtype = c3.selectbox("Low precision", ["float16", "bfloat16"], key="rs_dtype")
    if preset == "custom":
        return [s.strip() for s in custom.split(",") if s.strip()], None, dtype
    if preset == "none":
        return [], None, dtype
    return list(PRESETS[preset].injections), PRESETS[preset].norm_eps, dtype


def rescue_section(run, model) -> None:
    st.subheader("fp32 rescue set")
    st.caption("Which units must compute in fp32 for a float16 / bfloat16 run (with a fault, or as it is) to stay "
               "finite and agree with fp32 on ≥ 99 % of its top-1 tokens (a different top-1 where fp32's top two are "
               "within 4 spacings of the low dtype is a tie and is not counted)? Bisection over attn, mlp, resid (the "
               "residual stream in fp32 from that layer on), final_norm and logits; the set is then verified, and "
               "its complement is shown not to fix the run.")
    _reference_note(model)
    specs, norm_eps, dtype = _rescue_choices()
    tokens = checked(st.number_input("Generated tokens compared", 1, MAX_RESCUE_TOKENS, MAX_NEW_TOKENS,
                                     key="rs_tokens"), 1, MAX_RESCUE_TOKENS, "Generated tokens compared")
    store = session().memo("rs_reports")
    key = (*run_key(run), tuple(specs), norm_eps, dtype, tokens)

    def compute(progress):
        ref = model if model.dtype == torch.float32 else cast_model(model, "float32")
        low = cast_model(ref, dtype)             # dropped with this call: one extra model at a time
        return find_rescue(ref, low, settings, injections=specs, norm_eps=norm_eps, max_new_tokens=tokens,
                           on_progress=progress)
    what = "the fp32 rescue search"
    if (st.button("Find the rescue set", key="rs_run", type="primary") or was_stopped(what, key)) \
            and (settings := _checked_settings(run, model)):
        _compute(store, key, what, compute)
    report = store.get(key)
    if report is not None:
        show_rescue(report, run, model.config.num_layers, device=model.device.type)


def show_rescue(report, run, num_layers: int, device: str | None = None) -> None:
    faults = ", ".join(report.injections) or "no fault"
    if report.fp32 is None:
        st.error(f"{report.dtype}, {faults}: no fp32 set found. {report.note}")
    elif not report.fp32:
        st.success(f"{report.dtype}, {faults}: {report.note}")
    else:
        st.warning(f"{report.dtype}, {faults} ({', '.join(report.trigger)}): keep **{', '.join(report.fp32)}** in "
                   f"fp32. Verified: finite {report.finite}, top-1 agreement {report.top1_agreement:.1%} outside ties.")
    if report.near_ties:
        st.info(f"Near ties at step(s) {', '.join(str(t['step']) for t in report.near_ties)}: fp32's top two logits "
                f"are closer than {report.tie_ulps} {report.dtype} spacings ("
                + ", ".join(f"{t['gap']:.4f} < {t['margin']:.4g}" for t in report.near_ties)
                + "), so rounding alone can swap them: a different top-1 there is a tie, not a disagreement, and no "
                "unit joins the set for it."
                + (f" The set's run took the other token at step(s) {', '.join(map(str, report.ties))}."
                   if report.ties else ""))
    c = st.columns(3)
    c[0].metric("Units in fp32", "—" if report.fp32 is None else len(report.fp32))
    c[1].metric("Reruns", f"{report.reruns} (bound {report.bound})")
    if report.complement:
        c[2].metric("Complement fixes it", "yes" if report.complement["fixes"] else "no",
                    help=f"{report.complement['units']} units in fp32, every one but the set")
    if report.fp32:
        chart(pv.rescue_figure(report, num_layers), key="rs_units_fig")
        cmd = check_command(run.settings, report, device=device)
        if cmd:
            st.markdown("Check it with the doctor from the command line (`--verify` judges the plan exactly as the "
                        "search judged each rerun):")
            st.code(cmd, language="bash", wrap_lines=True)
    st.dataframe(pv.rescue_trials_frame(report), key="rs_trials", hide_index=True)
    st.caption(f"Every rerun computes the run as generation does: the prompt prefilled into a KV cache, then the fp32 "
               f"run's {report.tokens} tokens one at a time ({report.positions} positions), stopping at the first "
               "non-finite stage; the check command's --verify computes the same.")


# ---- Quantization page ----------------------------------------------------------------------------
def quantization_section(run, model) -> None:
    st.caption("The model's block matrices re-quantized with the gguf package's own quantizers and dequantized, "
               "then run over this run's tokens beside the float32 weights: the relative error of every stage, "
               "layer by layer, and per generated step the KL divergence and whether the top token agrees. The "
               "bundled model's reference weights are themselves Q4_1 (dequantized): Q4_1 reproduces them, and "
               "other formats quantize them a second time.")
    _reference_note(model)
    c1, c2, c3 = st.columns([3, 1, 1])
    formats = c1.multiselect("Formats", list(QUANT_CHOICES), default=["Q8_0", "Q4_0"], key="qz_formats")
    threshold = c2.number_input("Threshold", 0.001, 1.0, THRESHOLD, format="%.3f", key="qz_threshold",
                                help="relative error of the residual stream that counts as 'over'")
    embed = c3.checkbox("Quantize the embedding too", key="qz_embed")
    ids = run.ids[:MAX_QUANT_POSITIONS]
    if len(ids) <= run.n_prompt:
        st.info("This run generated no token within the first positions: nothing to compare per step.")
        return
    store = session().memo("qz_reports")
    key = (*run_key(run), tuple(formats), embed)

    def compute(progress):
        ref = model if model.dtype == torch.float32 else cast_model(model, "float32")
        return compare_formats(ref, ids, run.n_prompt, formats, embed=embed, text=run.result.text,
                               on_progress=progress)
    what = "the quantization comparison"
    if st.button("Quantize and compare", key="qz_run", type="primary", disabled=not formats) \
            or (formats and was_stopped(what, key)):
        _compute(store, key, what, compute)
    report = store.get(key)
    if report is not None:
        show_quant(report.with_threshold(float(threshold)))


def show_quant(report) -> None:
    st.dataframe(pv.quant_summary_frame(report), key="qz_summary", hide_index=True)
    log_y = st.toggle("Logarithmic error axis", key="qz_log")
    chart(pv.quant_layers_figure(report, log_y=log_y), key="qz_layers")
    st.caption(f"The error of the residual stream after each block: each line is one format. Where a line "
               f"crosses the dashed threshold ({report.threshold:g}) is that format's first layer over.")
    chart(pv.quant_steps_figure(report), key="qz_steps")
    fmt = st.selectbox("Every stage of one format", [r.format for r in report.formats], key="qz_heat_fmt")
    chart(pv.quant_heatmap(report, fmt), key="qz_heat")
    st.dataframe(pv.quant_stage_frame(report), key="qz_table", hide_index=True)
