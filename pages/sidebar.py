"""The sidebar every page shares: model, device, dtype, prompt, generation settings, Run, the runs kept.

A run is checked against the server's limits and waits for a device slot; a waiting user sees their place
in the queue. The run (engine.Trace) lives in this session's st.session_state only.
"""
from __future__ import annotations

import time

import streamlit as st
import torch

from engine import EngineError, InputError, Model, RunSettings, SamplingParams, Trace
from inspector.session.admission import shared_admission
from inspector.session.limits import Limits
from inspector.session.models import model_choices
from inspector.session.run import inspect_run, live_runs
from pages.common import RUN_KEY, RUNS_KEY, current_run, get_model, log, server_limits
from pages.widgets import sampling_params_from, sampling_widgets


def sidebar() -> Model | None:
    sb = st.sidebar
    limits = server_limits()
    sb.title("LLM Inspector")
    sb.selectbox("Model", list(model_choices()), key="sb_model")
    c1, c2 = sb.columns(2)
    c1.selectbox("Device", ["auto", "cpu"] + (["cuda"] if torch.cuda.is_available() else []), key="sb_device")
    c2.selectbox("Dtype", ["auto", "float32", "bfloat16", "float16"], key="sb_dtype")
    model = get_model()
    if model is not None:
        sb.caption(f"{model.name} · {model.config.num_layers} layers · {model.device.type} · "
                   f"{str(model.dtype).removeprefix('torch.')}")
    sb.text_area("Prompt", "What is the capital of France?", key="sb_prompt", height=100,
                 help=f"Up to {limits.max_prompt_chars:,} characters and {limits.max_prompt_tokens:,} tokens. "
                      "Tab, newline and carriage return are the only control characters accepted.")
    sb.toggle("Chat format", value=True, key="sb_chat")
    with sb.expander("Generation settings"):
        st.number_input("Max new tokens", 1, limits.max_new_tokens, min(32, limits.max_new_tokens), key="sb_max_new")
        sampling_widgets("sb", SamplingParams())
        st.number_input("Seed", 0, 2**31 - 1, 0, key="sb_seed")
        st.toggle("Special-token text in the prompt acts as control tokens", value=False, key="sb_allow_special")
    if sb.button("Run", type="primary", key="sb_run", disabled=model is None, use_container_width=True):
        try:
            settings = settings_from_sidebar()
        except (TypeError, ValueError, InputError) as e:
            sb.error(f"Invalid generation setting: {e}")
        else:
            run_model(model, settings)
    history(limits)
    run = current_run()
    for note in (run.notes if run is not None else []):
        sb.warning(note)
    a = shared_admission(limits).state()
    sb.caption(f"Server: {a.running} of {a.max_concurrent} run slots busy · {a.waiting} waiting · "
               f"{live_runs()} runs in memory")
    return model


def settings_from_sidebar() -> RunSettings:
    s = st.session_state
    return RunSettings(prompt=s["sb_prompt"], chat=s["sb_chat"], max_new_tokens=int(s["sb_max_new"]),
                       params=sampling_params_from("sb"), seed=int(s["sb_seed"]),
                       allow_special=bool(s["sb_allow_special"]))


def run_model(model: Model, settings: RunSettings) -> Trace | None:
    """Generate with full inspection, streaming the text into the sidebar; keep the run in this session.
    Any failure is a message in the sidebar; the model and every other session carry on."""
    box = st.sidebar.empty()
    bar = st.sidebar.progress(0.0, text="generating")
    text: list[str] = []
    limits = server_limits(show_error=False)       # the sidebar says it when one is malformed
    queued: list[tuple[float, int]] = []           # (when, place) each time the queue reported

    def on_queue(position: int) -> None:
        queued.append((time.monotonic(), position))
        bar.progress(0.0, text=f"waiting: number {position} in the queue")
        box.info(f"The server is busy. You are number {position} in the queue; your run starts as soon as "
                 "a slot is free.")

    def on_token(step) -> None:
        text.append(step.text)
        box.code("".join(text), language=None, wrap_lines=True)
        bar.progress(min(1.0, (step.index + 1) / settings.max_new_tokens), text=f"token {step.index + 1}")

    try:
        record = inspect_run(model, settings, on_token=on_token, limits=limits, on_queue=on_queue)
    except EngineError as e:
        st.sidebar.error(str(e))
        return None
    except Exception as e:    # an engine bug: say so, keep the server and the model going
        log.exception("run failed")
        st.sidebar.error(f"The run failed unexpectedly ({type(e).__name__}: {e}). The model is still loaded; "
                         "please report this with the prompt and settings.")
        return None
    finally:
        bar.empty()
        box.empty()
    keep_run(record, limits.max_runs_kept)
    if queued:
        st.sidebar.caption(f"This run waited {time.monotonic() - queued[0][0]:.1f} s in the queue "
                           f"(it arrived as number {queued[0][1]}).")
    return record


def keep_run(record: Trace, max_runs: int) -> None:
    """Make record the current run; drop runs beyond max_runs, and what pages memoised for them."""
    runs: list[Trace] = [r for r in st.session_state.get(RUNS_KEY, []) if r is not record] + [record]
    dropped, runs = runs[:-max_runs], runs[-max_runs:]
    for key in (RUNS_KEY, RUN_KEY):     # deleted first: Streamlit also keeps the previous script run's values
        if key in st.session_state:
            del st.session_state[key]
    st.session_state[RUNS_KEY] = runs
    st.session_state[RUN_KEY] = record
    st.session_state.pop("selected_step", None)   # the debugger's step belongs to the debugger's run
    gone = {(id(r), r.created) for r in dropped}
    for key in list(st.session_state.keys()) if gone else []:
        store = st.session_state[key]
        if isinstance(store, dict):   # page memos keyed by session.memo.run_key(run) or (run_key, ...)
            for k in [k for k in store if k in gone or (isinstance(k, tuple) and k and k[0] in gone)]:
                del store[k]


def history(limits: Limits) -> None:
    """With more than one kept run, a selectbox to show an earlier one."""
    runs: list[Trace] = st.session_state.get(RUNS_KEY, [])
    if len(runs) < 2:
        return
    by_time = {r.created: r for r in runs}
    if st.session_state.get("_history_newest") != runs[-1].created or st.session_state.get("sb_history") not in by_time:
        st.session_state["_history_newest"] = st.session_state["sb_history"] = runs[-1].created   # a new run shows
    labels = {r.created: f"{time.strftime('%H:%M:%S', time.localtime(r.created))} · {r.settings.prompt[:30]!r} · "
                         f"{len(r.result.token_ids)} tokens" for r in runs}

    def show() -> None:    # only when the user picks: a run another page published stays current otherwise
        st.session_state[RUN_KEY] = by_time[st.session_state["sb_history"]]
        st.session_state.pop("selected_step", None)

    st.sidebar.selectbox(f"Run shown (this session keeps {limits.max_runs_kept})", list(reversed(by_time)),
                         format_func=labels.get, key="sb_history", on_change=show)
