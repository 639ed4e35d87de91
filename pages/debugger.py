"""Debugger: generate one token at a time with the live engine. Step / Continue (to a breakpoint or the end) /
Run to end / Reset; conditional breakpoints; new sampler settings after a break. After every step the run so
far is this session's current run (SessionState.run) and the step shown is SessionState.selected_step, so every
other page shows the run's state at that step."""
import dataclasses
import math
from fnmatch import fnmatchcase

import streamlit as st

from engine import EngineError, InputError, RunSettings, SamplingParams
from engine.tools.breakpoints import AbsAbove, EntropyBelow, NonFinite, RepeatedNgram, RoutedTo
from inspector.session.stepper import Debugger
from inspector.ui.common import current_run, device_slot, get_model, plain, server_limits
from inspector.ui.frame import ensure_frame
from inspector.ui.sidebar import settings_from_sidebar
from inspector.ui.state import session
from inspector.ui.widgets import (
    FILTERS,
    PENALTIES,
    SAMPLER_WIDGETS,
    checked,
    checked_float,
    checked_text,
    sampling_params_from,
    sampling_widgets,
    set_sampling_widgets,
    widget_key,
)
from inspector.views.debugger import candidates_table, describe_step, params_table, token_breakpoint
from inspector.views.sampling import describe as describe_params
from inspector.views.tokens import steps_table

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

KINDS = ["NaN / Inf", "|value| above", "Entropy below", "Repeated n-gram", "Token", "Routed to expert"]
MAX_FIELD_CHARS = 200         # a stage glob or a token's text: matched against every stage / tokenized
MAX_NGRAM = 20
s, ss = st.session_state, session()      # widget values; this session's SessionState

st.header("Debugger")
model = get_model()
if model is None:
    st.stop()


def sidebar_settings() -> RunSettings:
    """The sidebar's prompt and settings (defaults when this page runs without the app's frame)."""
    if "sb_prompt" in s:
        return settings_from_sidebar()
    return RunSettings(prompt="What is the capital of France?")


def run_settings() -> RunSettings | None:
    """The settings of the run the other pages show (a trace file opened, an earlier run chosen): those of the
    debugger's own run while that is the current one, so Reset starts it over."""
    cur, dbg = current_run(), ss.debugger
    if cur is not None and (dbg is None or cur is not dbg.published):
        return cur.settings
    return dbg.settings if dbg is not None else None


def start_settings() -> RunSettings:
    """What Step / Reset start a new run from, said on the page: the current run's prompt and settings where
    its prompt is not the sidebar's (after opening a trace file the sidebar still holds its own), unless the
    user picks the sidebar's; otherwise the sidebar's, as a sidebar Run would."""
    run = run_settings()
    differs = run is not None and (run.prompt, run.chat, run.system) != (s.get("sb_prompt"), s.get("sb_chat"), None)
    use_run = differs and ("sb_prompt" not in s or st.radio(     # no sidebar: this page run without the app's frame
        "Prompt and settings from", ["the current run", "the sidebar"], key="dbg_source",
        horizontal=True) == "the current run")
    shown = run.prompt if use_run else s.get("sb_prompt", "What is the capital of France?")
    st.caption(f"Step and Reset start a run of **{'the current run' if use_run else 'the sidebar'}'s** prompt: "
               f"{plain(repr(shown)[:200])}" + (" (the run every other page shows; choose the sidebar to run "
                                                "its prompt instead)" if use_run else ""))
    if not use_run:
        return sidebar_settings()
    limit = server_limits(show_error=False).max_new_tokens       # a file's run may ask for more than this server
    n = run.max_new_tokens
    return dataclasses.replace(run, max_new_tokens=min(n, limit)) if type(n) is int and n >= 1 else run


def new_debugger(old: Debugger | None, settings) -> Debugger | None:
    """A fresh run from these settings (checked against the server's limits, as the sidebar's Run is)."""
    if old is not None and current_run() is old.published:     # the pages stop showing the old run
        ss.run = ss.selected_step = None
    ss.debugger = None
    try:
        dbg = Debugger(model, settings, ss.breakpoints, limits=server_limits())
    except (EngineError, TypeError, ValueError) as e:
        st.error(f"Could not start the run: {e}")
        return None
    ss.debugger = dbg
    set_sampling_widgets("dbg", dbg.run.params)
    return dbg


def glob_input(box, key: str) -> str:
    return checked_text(box.text_input("Stages (glob)", "*", key=key, max_chars=MAX_FIELD_CHARS), MAX_FIELD_CHARS,
                        "Stages (glob)")


def publish(dbg: Debugger) -> None:
    """The run so far becomes the session's current run; the newest step is the selected one."""
    if dbg.steps:                            # pages expect at least one step in a run
        ss.run = dbg.record()
        ss.selected_step = s["dbg_view_step"] = len(dbg.steps) - 1


try:
    start: RunSettings | EngineError = start_settings()
except EngineError as e:      # a sidebar number out of range: said when a run is started from it
    start = e
c = st.columns(4)
reset = c[0].button("Reset", key="dbg_reset", use_container_width=True,
                    help="A new run from the prompt and settings named above (breakpoints are kept)")
do_step = c[1].button("Step", key="dbg_step", type="primary", use_container_width=True)
do_cont = c[2].button("Continue", key="dbg_continue", use_container_width=True,
                      help="Run until a breakpoint fires or the run ends")
do_end = c[3].button("Run to end", key="dbg_run_end", use_container_width=True, help="Ignore breakpoints")

dbg: Debugger | None = ss.debugger
if reset or ((do_step or do_cont or do_end) and (dbg is None or dbg.model_name != model.name)):
    if isinstance(start, EngineError):
        st.error(f"Could not start the run: {start}")
        dbg = None
    else:
        dbg = new_debugger(dbg, start)
if dbg is not None and (do_step or do_cont or do_end):
    if dbg.done:
        st.info(f"The run has ended ({dbg.run.stop_reason}); press Reset for a new one.")
    else:
        try:
            if dbg.set_params(sampling_params_from("dbg", dbg.run.params)):
                st.toast(f"New sampler settings from step {len(dbg.steps)} on")
            dbg.breakpoints = list(ss.breakpoints)
            live = st.empty()
            # the text so far after each token; a Streamlit call per token also lets Stop / a rerun end a long
            # Continue between two steps (the run stays consistent, and is published on the next rerun)
            dbg.run.on_token = lambda step: live.caption(f"step {step.index}: …{dbg.run.text[-120:]}")
            try:
                with device_slot("the next tokens"), st.spinner("Generating…"):
                    if do_step:
                        dbg.step()
                    elif do_cont:
                        dbg.cont()
                    else:
                        dbg.run_to_end()
            finally:
                dbg.run.on_token = None
                live.empty()
        except EngineError as e:
            bad = dbg.probe.recording.first_nonfinite()
            st.error(f"The engine stopped: {e}" + (f" (first NaN/Inf: {bad[0].name} at step {bad[0].step}, "
                                                   f"position {bad[1]})" if bad else ""))
        publish(dbg)
elif dbg is not None and dbg.steps and (dbg.published is None or (current_run() is dbg.published and len(
        dbg.published.result.steps) != len(dbg.steps))):
    publish(dbg)                             # steps an interrupted rerun took but did not publish

if dbg is None:
    st.info("Press **Step** to start generating the prompt named above one token at a time.")
elif dbg.model_name != model.name:
    st.warning(f"This run uses **{plain(dbg.model_name)}**; the sidebar now shows **{plain(model.name)}**. "
               "Press Reset.")

# ---- breakpoints -----------------------------------------------------------------------------------
with st.expander(f"Breakpoints ({len(ss.breakpoints)})", expanded=True):
    c1, c2, c3 = st.columns([2, 3, 1])
    kind = c1.selectbox("Break on", KINDS if model.config.num_experts else KINDS[:-1], key="dbg_bp_kind")
    try:
        if kind == "NaN / Inf":
            bp = NonFinite(glob_input(c2, "dbg_bp_stage"))
        elif kind == "|value| above":
            thr = checked_float(c2.number_input("Threshold", 0.0, value=1000.0, key="dbg_bp_abs"), 0.0, math.inf,
                                "Threshold")
            bp = AbsAbove(thr, glob_input(st, "dbg_bp_abs_stage"))
        elif kind == "Entropy below":
            bp = EntropyBelow(checked_float(c2.number_input("Entropy (nats)", 0.0, value=0.5, step=0.1,
                                                            key="dbg_bp_entropy"), 0.0, math.inf, "Entropy (nats)"))
        elif kind == "Repeated n-gram":
            bp = RepeatedNgram(checked(c2.number_input("n", 1, MAX_NGRAM, 3, key="dbg_bp_n"), 1, MAX_NGRAM, "n"),
                               st.toggle("Count n-grams of the prompt too", False, key="dbg_bp_prompt"))
        elif kind == "Routed to expert":
            cfg = model.config
            if not cfg.num_experts:
                raise InputError(f"{model.name} has no experts: routing breakpoints are for mixtures of experts")
            layers = [i for i in range(cfg.num_layers) if cfg.layer_moe[i]]
            layer = c2.selectbox("Layer", layers, key="dbg_bp_moe_layer")
            bp = RoutedTo(int(layer), checked(c2.number_input("Expert", 0, cfg.num_experts - 1, 0, key="dbg_bp_expert"),
                                              0, cfg.num_experts - 1, "Expert"))
        else:
            text = checked_text(c2.text_input("Token text (' Paris') or id(s)", key="dbg_bp_token",
                                              max_chars=MAX_FIELD_CHARS), MAX_FIELD_CHARS, "Token text")
            bp = token_breakpoint(model.tokenizer, text, model.config.vocab_size) if text else None
        stage = getattr(bp, "stage", None)
        if stage is not None and not any(fnmatchcase(n, stage) for n in model.hook_names()):
            raise InputError(f"no stage matches {stage!r}; stages are named like blocks.0.mlp.act (see Activations)")
    except EngineError as e:
        st.error(str(e))
        bp = None
    if c3.button("Add", key="dbg_bp_add", disabled=bp is None, use_container_width=True) and bp not in ss.breakpoints:
        ss.breakpoints = ss.breakpoints + [bp]
        st.rerun()
    for i, b in enumerate(ss.breakpoints):
        r1, r2 = st.columns([5, 1])
        r1.markdown(f"`{i}` {plain(b.describe())}")
        if r2.button("Remove", key=f"dbg_bp_rm_{i}", use_container_width=True):
            ss.breakpoints = ss.breakpoints[:i] + ss.breakpoints[i + 1:]
            st.rerun()

# ---- the sampler for the next steps -----------------------------------------------------------------
if any(widget_key("dbg", name) not in s for name in SAMPLER_WIDGETS):   # first visit, or back from another page
    # a sidebar number out of range (said above Run): the sampler starts at the defaults
    first = dbg.run.params if dbg is not None else start.params if isinstance(start, RunSettings) else \
        SamplingParams()
    set_sampling_widgets("dbg", first)
with st.expander("Sampler for the next steps (applied at Step / Continue)", expanded=bool(dbg and dbg.message)):
    p = st.columns(2)
    sampling_widgets("dbg", SamplingParams(), FILTERS, p[0])
    sampling_widgets("dbg", SamplingParams(), PENALTIES, p[1])
if dbg is None:
    st.stop()

# ---- where the run stands -------------------------------------------------------------------------
steps, tok = dbg.steps, model.tokenizer if dbg.model_name == model.name else None
for note in dbg.notes:
    st.info(plain(note))
if dbg.message:
    st.warning(f"Breakpoint: {dbg.message}", icon="⏸️")
cur = current_run()
if dbg.published is not None and cur is not dbg.published:
    st.info("Another run is now the current run of the other pages; Step or Continue publishes this one again.")
state = f"ended ({dbg.run.stop_reason})" if dbg.done else "paused"
st.caption(f"{len(steps)} of at most {dbg.run.max_new_tokens} tokens · {state} · {dbg.seconds:.2f} s with full "
           f"inspection · seed {dbg.run.seed}")
st.code(dbg.run.text or "(nothing yet)", language=None, wrap_lines=True)
if not steps:
    st.stop()

if "dbg_view_step" not in s:                              # first visit, or back from another page
    s["dbg_view_step"] = len(steps) - 1 if ss.selected_step is None else ss.selected_step
s["dbg_view_step"] = min(max(int(s["dbg_view_step"]), 0), len(steps) - 1)
view = checked(st.number_input(f"Step shown (0–{len(steps) - 1}); every page shows this step", 0, len(steps) - 1,
                              key="dbg_view_step"), 0, len(steps) - 1, "Step shown")
if cur is not None and cur is dbg.published:
    ss.selected_step = view
step = steps[view]
st.markdown(f"**{plain(describe_step(step, tok))}**")
m = st.columns(4)
m[0].metric("Chosen token", repr(step.text) if tok is None else repr(tok.decode([step.token_id])))
m[1].metric("p (sampling)", f"{step.prob:.4f}")
m[2].metric("Entropy (nats)", f"{step.entropy:.3f}")
m[3].metric("Tokens kept", f"{step.kept:,}")
st.caption(f"Sampler at this step: {describe_params(dbg.params_at(view))}")
left, right = st.columns([2, 3])
left.dataframe(candidates_table(step, tok), hide_index=True, key="dbg_candidates",
               column_config={"model_prob": st.column_config.NumberColumn(format="%.4f")})
right.dataframe(steps_table(steps, tok), hide_index=True, key="dbg_steps",
                column_config={"prob": st.column_config.NumberColumn(format="%.4f"),
                               "model_prob": st.column_config.NumberColumn(format="%.4f"),
                               "entropy": st.column_config.NumberColumn(format="%.3f")})
if len(dbg.params_log) > 1:
    st.subheader("Sampler changes")
    st.dataframe(params_table(dbg.params_log), hide_index=True, key="dbg_params_log")
