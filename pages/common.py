"""What every page shares: the one model loader, the sidebar (model, prompt, settings, Run), the current run.

The model is loaded once per process and shared by every browser session; a run and everything derived from
it lives in that session's st.session_state only, so it goes when the session ends. Runs are checked
against the server's limits and wait for a device slot (inspector.limits, inspector.admission); a waiting
user sees their place in the queue.

Models come only from a fixed list (model_choices): the server default ($LLM_INSPECTOR_MODEL), the bundled
model, models under $LLM_INSPECTOR_MODEL_ROOTS and the local hub cache. The browser picks a label from it;
it never sends a path.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import streamlit as st
import torch
from streamlit.runtime.pages_manager import PagesManager

from engine import EngineError, Model, ModelLoadError, load_model
from engine.loader import pick_device, pick_dtype
from engine.sources import find_in_hub_cache, hub_cache_dirs
from inspector.admission import shared_admission, slot
from inspector.limits import Limits, LimitsConfigError, env_name
from inspector.run import RunRecord, RunSettings, inspect_run, live_runs

BUNDLED = "SmolLM2-135M-Instruct (bundled)"
RUN_KEY = "run"            # the run the pages show
RUNS_KEY = "runs"          # the runs this session keeps, oldest first (at most max_runs_kept)
LOAD_RETRY_S = 30          # a model that failed to load is not tried again for this long (all sessions)
log = logging.getLogger("llm_inspector")


def model_roots() -> list[Path]:
    """Folders whose models the browser may choose from ($LLM_INSPECTOR_MODEL_ROOTS, os.pathsep separated)."""
    raw = os.environ.get("LLM_INSPECTOR_MODEL_ROOTS", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


@st.cache_data(ttl=60, show_spinner=False)
def model_choices() -> dict[str, str | None]:
    """Display label -> source, for the bundled model, models under the roots and the hub cache."""
    choices: dict[str, str | None] = {}
    default = os.environ.get("LLM_INSPECTOR_MODEL")
    if default:
        choices[f"{Path(default).name} (server default)"] = default
    choices[BUNDLED] = None
    for root in model_roots():
        if not root.is_dir():
            continue
        for p in sorted(root.iterdir()):
            if (p / "config.json").is_file() or p.suffix == ".gguf":
                choices[f"{p.name} ({root})"] = str(p)
    for hub in hub_cache_dirs():
        if hub.is_dir():
            for repo in sorted(hub.glob("models--*--*")):
                repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
                snap = find_in_hub_cache(repo_id)
                if snap is not None and (snap / "config.json").is_file():
                    choices[f"{repo_id} (hub cache)"] = repo_id
    return choices


def server_limits(show_error: bool = True) -> Limits:
    """This server's limits ($LLM_INSPECTOR_MAX_*); the defaults if one is malformed (said in the sidebar)."""
    try:
        return Limits.from_env()
    except LimitsConfigError as e:
        if show_error:
            st.sidebar.error(f"Server configuration: {e}. Using the default limits.")
        return Limits()


# ---- the shared model -----------------------------------------------------------------------------------------
# A process-wide registry rather than st.cache_resource: a cached function that draws a progress bar made
# outside it cannot be replayed for the next session (CacheReplayClosureError), and any client may ask
# Streamlit to clear its caches, which would drop the model every session shares.
class _Slot:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.model: Model | None = None
        self.error: tuple[float, str] | None = None     # (when, message) of the last failed load


_models: dict[tuple, _Slot] = {}
_models_lock = threading.Lock()


def shared_model(source: str | None, device: str, dtype: str, _progress=None) -> Model:
    """The model for (source, device, dtype), loaded at most once per process and shared by all sessions.
    Raises ModelLoadError (with the reason) for a model that cannot be loaded or would exceed max_models."""
    dev = pick_device(device)
    key = (source, str(dev), str(pick_dtype(None if dtype == "auto" else dtype, dev)))
    limit = server_limits(show_error=False).max_models
    with _models_lock:
        slot = _models.get(key)
        if slot is None:
            loaded = [k for k, s in _models.items() if s.model is not None]
            if len(loaded) >= limit:
                names = "; ".join(f"{k[0] or 'bundled'} ({k[1]}, {k[2].removeprefix('torch.')})" for k in loaded)
                raise ModelLoadError(f"this server keeps at most {limit} model(s) loaded ({env_name('max_models')}) "
                                     f"and that many are: {names}. Choose one of those.")
            slot = _models[key] = _Slot()
    if not slot.lock.acquire(blocking=False):
        if _progress:
            _progress(0.0, "another session is loading this model…")
        slot.lock.acquire()
    try:
        if slot.model is None:
            if slot.error and time.monotonic() - slot.error[0] < LOAD_RETRY_S:
                raise ModelLoadError(slot.error[1])
            try:
                slot.model = load_model(source, device=dev, dtype=key[2].removeprefix("torch."), progress=_progress)
            except Exception as e:
                log.warning("loading model %r failed", source, exc_info=not isinstance(e, EngineError))
                msg = str(e) if isinstance(e, EngineError) else f"{source}: {type(e).__name__}: {e}"
                slot.error = (time.monotonic(), msg)
                raise ModelLoadError(msg) from None
            slot.error = None
        return slot.model
    finally:
        slot.lock.release()


def _clear_models() -> None:
    with _models_lock:
        _models.clear()


shared_model.clear = _clear_models     # as st.cache_resource offered: tests and admins start afresh


def get_model() -> Model | None:
    """The model chosen in the sidebar, loading it (with a progress bar) the first time in this process."""
    label = st.session_state.get("sb_model")
    choices = model_choices()
    source = choices.get(label, next(iter(choices.values())))     # never anything outside the list
    device = st.session_state.get("sb_device", "auto")
    device = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    dtype = st.session_state.get("sb_dtype", "auto")
    bar = st.sidebar.empty()
    try:
        model = shared_model(source, device, dtype,
                             _progress=lambda f, msg: bar.progress(min(max(f, 0.0), 1.0), text=msg))
    except EngineError as e:
        st.sidebar.error(f"Could not load the model: {e}")
        return None
    finally:
        bar.empty()
    return model


@contextmanager
def device_slot(what: str = "this computation"):
    """Wait for a device slot (showing the place in the queue) around on-demand model work on a page."""
    box = st.empty()
    try:
        with slot(on_wait=lambda n: box.info(f"The server is busy: you are number {n} in the queue for {what}."),
                  limits=server_limits(show_error=False)):
            box.empty()
            yield
    finally:
        box.empty()


# ---- the sidebar --------------------------------------------------------------------------------------------
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
        st.slider("Temperature", 0.0, 2.0, 0.0, 0.05, key="sb_temperature")
        st.number_input("Top-k (0 = off)", 0, 1000, 0, key="sb_top_k")
        st.slider("Top-p", 0.01, 1.0, 1.0, 0.01, key="sb_top_p")
        st.slider("Min-p", 0.0, 1.0, 0.0, 0.01, key="sb_min_p")
        st.slider("Repetition penalty", 0.5, 2.0, 1.0, 0.05, key="sb_rep")
        st.slider("Frequency penalty", -2.0, 2.0, 0.0, 0.1, key="sb_freq")
        st.slider("Presence penalty", -2.0, 2.0, 0.0, 0.1, key="sb_pres")
        st.number_input("No-repeat n-gram (0 = off)", 0, 10, 0, key="sb_ngram")
        st.number_input("Seed", 0, 2**31 - 1, 0, key="sb_seed")
        st.toggle("Special-token text in the prompt acts as control tokens", value=False, key="sb_allow_special")
    if sb.button("Run", type="primary", key="sb_run", disabled=model is None, use_container_width=True):
        try:
            settings = settings_from_sidebar()
        except (TypeError, ValueError) as e:
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
                       temperature=float(s["sb_temperature"]), top_k=int(s["sb_top_k"]), top_p=float(s["sb_top_p"]),
                       min_p=float(s["sb_min_p"]), repetition_penalty=float(s["sb_rep"]),
                       frequency_penalty=float(s["sb_freq"]), presence_penalty=float(s["sb_pres"]),
                       no_repeat_ngram=int(s["sb_ngram"]), seed=int(s["sb_seed"]),
                       allow_special=bool(s["sb_allow_special"]))


def run_model(model: Model, settings: RunSettings) -> RunRecord | None:
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


def keep_run(record: RunRecord, max_runs: int) -> None:
    """Make record the current run; drop runs beyond max_runs, and what pages memoised for them."""
    runs: list[RunRecord] = [r for r in st.session_state.get(RUNS_KEY, []) if r is not record] + [record]
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
        if isinstance(store, dict):   # page memos keyed by inspector.attention.run_key(run) or (run_key, ...)
            for k in [k for k in store if k in gone or (isinstance(k, tuple) and k and k[0] in gone)]:
                del store[k]


def history(limits: Limits) -> None:
    """With more than one kept run, a selectbox to show an earlier one."""
    runs: list[RunRecord] = st.session_state.get(RUNS_KEY, [])
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


_IN_FRAME: ContextVar[bool] = ContextVar("llm_inspector_in_frame", default=False)


@contextmanager
def frame():
    """app.py runs the chosen page inside this, so a page can tell it has the sidebar around it."""
    token = _IN_FRAME.set(True)
    try:
        yield
    finally:
        _IN_FRAME.reset(token)


def ensure_frame() -> None:
    """Streamlit treats a folder named pages/ beside app.py as an old-style multipage app until app.py's
    st.navigation runs: on a freshly started server, the first request for a page URL runs that page alone,
    without the sidebar. A page that finds itself outside app.py switches Streamlit to app.py's
    navigation and reruns once, which brings the sidebar back on the same URL."""
    if _IN_FRAME.get():
        return
    PagesManager.uses_pages_directory = False
    if not st.session_state.get("_frame_rerun"):
        st.session_state["_frame_rerun"] = True
        st.rerun()


def current_run() -> RunRecord | None:
    ensure_frame()
    return st.session_state.get(RUN_KEY)


def require_run() -> RunRecord:
    """The session's current run, or a hint to press Run (and the page stops there)."""
    run = current_run()
    if run is None:
        st.info("Enter a prompt in the sidebar and press **Run** to inspect a generation.")
        st.stop()
    return run


def require_run_and_model(purpose: str = "inspect it"):
    """The current run and the loaded model it was made with; otherwise a message and the page stops."""
    run = require_run()
    model = get_model()
    if model is None:
        st.stop()
    if model.name != run.model_name:
        st.warning(f"This run was made with **{run.model_name}**; the sidebar now shows **{model.name}**. "
                   f"Choose that model in the sidebar (or press Run again) to {purpose}.")
        st.stop()
    return run, model


def on_demand(store, k, what: str, compute, **bounds):
    """memo(store, k, compute), holding a device slot (queue shown) and a spinner only when it computes."""
    from inspector.attention import memo
    if k in store:
        return memo(store, k, compute, **bounds)
    try:
        with device_slot(what), st.spinner(f"Computing {what}…"):
            return memo(store, k, compute, **bounds)
    except EngineError as e:
        st.error(str(e))
        st.stop()
