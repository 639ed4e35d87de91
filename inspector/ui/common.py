"""What the pages share: the model of the sidebar's choice (loaded in the background, its progress shown), the
current run, a device slot for on-demand model work, and the per-session memo around it. Widgets only; the model
registry, limits and queue live in inspector.session."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
from contextlib import contextmanager
from contextvars import ContextVar

import streamlit as st
import torch
from streamlit.runtime.scriptrunner import add_script_run_ctx, get_script_run_ctx

from engine import EngineError, Model, SamplingParams, Trace
from engine.heap import trim
from engine.progress import STOP, Progress, Stopped
from inspector.session.admission import set_client_resolver, slot
from inspector.session.budget import data_allowance, enforce
from inspector.session.clients import COOKIELESS
from inspector.session.limits import LimitError, Limits, LimitsConfigError, check_run_positions
from inspector.session.memo import memo
from inspector.session.model_choices import quant_of
from inspector.session.models import LOAD_RETRY_S, LoadState, model_choices, model_load
from inspector.session.on_demand import about, estimate, progress_text, record_rate
from inspector.session.server_memory import weights_text
from inspector.ui import st_internals
from inspector.ui.state import session

CLIENT_COOKIE = "_streamlit_xsrf"    # set once per browser by Streamlit (XSRF protection): shared by its tabs
log = logging.getLogger("llm_inspector")


def browser_key() -> str | None:
    """The browser asking (all its tabs share Streamlit's XSRF cookie), as a hash; None without the cookie or
    outside a script run."""
    try:
        cookie = st.context.cookies.get(CLIENT_COOKIE)
    except Exception:          # no script run context (a worker thread, a test calling functions directly)
        cookie = None
    if isinstance(cookie, str) and cookie:
        return "browser:" + hashlib.sha256(xsrf_token(cookie).encode()).hexdigest()[:16]
    return None


def admission_key() -> str | None:
    """Whom this session counts against (inspector.session.clients.sessions): its browser; without the browser
    cookie, every such session of the server together (COOKIELESS: a script cannot invent browsers by leaving it
    out); None outside a running server (AppTest), where nothing is counted."""
    browser = browser_key()
    if browser is not None:
        return browser
    return COOKIELESS if st_internals.serving() else None


def client_key() -> str | None:
    """Who is asking, for fair admission: the browser, else this session. None outside a script run."""
    browser = browser_key()
    if browser is not None:
        return browser
    ctx = get_script_run_ctx()
    return None if ctx is None else "session:" + ctx.session_id


set_client_resolver(client_key)


def xsrf_token(cookie: str) -> str:
    """The browser's token inside Streamlit's XSRF cookie. Tornado writes it masked ("2|mask|masked|time", a new
    random mask each time a page loads), so two tabs of one browser carry different cookie strings around the
    same token: unmask it (token = masked XOR mask). Any other form is taken as it is."""
    parts = cookie.split("|")
    if len(parts) == 4 and parts[0] == "2":
        try:
            mask, masked = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
        except ValueError:
            return cookie
        if mask:
            return bytes(b ^ mask[i % len(mask)] for i, b in enumerate(masked)).hex()
    return cookie


def server_limits(show_error: bool = True) -> Limits:
    """This server's limits ($LLM_INSPECTOR_MAX_*); the defaults if one is malformed (said in the sidebar)."""
    try:
        return Limits.from_env()
    except LimitsConfigError as e:
        if show_error:
            st.sidebar.error(f"Server configuration: {e}. Using the default limits.")
        return Limits()


# ---- the model, loaded in the background -----------------------------------------------------------------------
# A fresh server's first visitor sees the app at once: the sidebar asks without waiting (the load runs in a thread
# of the registry, inspector.session.models.model_load), shows the load's progress under its title and disables
# Run; the page is drawn; then the script waits for the load, updating the progress, and draws the app again with
# the model. A page that needs the model waits the same way.
_LOAD_BOX: ContextVar = ContextVar("llm_inspector_load_box", default=None)   # this script run's progress box
LOAD_POLL_S = 0.25


def chosen_source() -> str | None:
    """The source of the sidebar's model choice: one of model_choices(), never anything outside the list."""
    choices = model_choices()
    return choices.get(st.session_state.get("sb_model"), next(iter(choices.values())))


def chosen_load() -> LoadState:
    """The load of the model chosen in the sidebar (started if it is not loaded); never waits."""
    label, source = st.session_state.get("sb_model"), chosen_source()
    device = st.session_state.get("sb_device", "auto")
    device = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    dtype, quant = st.session_state.get("sb_dtype", "auto"), quant_of(st.session_state.get("sb_quant"), source)
    if quant != "dequantized":   # kept as stored: its products decode blocks on the CPU in float32 (load_model)
        device, dtype = "cpu", "float32"
    state = model_load(source, device, dtype, user=session(), quant=quant)
    if state.unloaded is not None and state.model is not None:      # said in the sidebar once the model is back
        session().model_notice = plain(state.unloaded.notice(label or "The model", loaded=True))
    return state


def get_model(wait: bool = True) -> Model | None:
    """The model chosen in the sidebar. While it loads: wait=False answers None at once (the sidebar, drawn with
    the load's progress); wait=True waits, showing the progress, and reruns the app once the model is there if
    the sidebar was drawn without it. A load that failed is said in the sidebar when waiting (None)."""
    state = chosen_load()
    if state.loading and wait:
        state = wait_for_model()
    if state.error is not None and wait:
        st.sidebar.error(f"Could not load the model: {state.error}")
    return state.model


def forget_load_box() -> None:
    """At the start of each script run of the app: no progress box drawn yet."""
    _LOAD_BOX.set(None)


def load_box(demo_waits: bool = False) -> None:
    """Where the sidebar names the model while there is none: the load's progress (updated while this script
    waits), or why it failed."""
    state = chosen_load()
    if state.error is not None and state.unsupported:     # reloading cannot help: this engine lacks the architecture
        st.error(f"Could not load the model: {state.error}. This app does not implement that model; the app keeps "
                 "running: choose another model (Model and device).")
    elif state.error is not None and state.refused:     # tried again at the next click: no wait to name
        st.error(f"Could not load the model: {state.error}")
    elif state.error is not None:
        st.error(f"Could not load the model: {state.error}. The app keeps running: choose another model "
                 f"(Model and device), or reload the page after {LOAD_RETRY_S} s to try again.")
    elif state.loading:
        if state.unloaded is not None:
            st.info(plain(state.unloaded.notice(st.session_state.get("sb_model") or "The model", loaded=False)))
        box = st.empty()
        _LOAD_BOX.set((box, demo_waits))
        _show_load(box, state, demo_waits)


def model_line(model: Model) -> None:
    """Where the sidebar names the loaded model: its family, size, device, dtype, weights' bytes by dtype and decode
    path; once, that it was unloaded to make room and loaded again."""
    acc = model.accelerator
    weights = {str(d).removeprefix("torch."): n for d, n in model.weights.nbytes_by_dtype().items()}
    # a GGUF file kept as stored counts its blocks' bytes under their formats (Weights.nbytes_by_dtype)
    mode = "" if not model.weights.quantized() else " as stored (GGUF blocks" + (
        ", llama.cpp's int8 products)" if "int8" in model.weights.kept_arithmetics() else ")")
    st.caption(f"Model: **{plain(model.name)}** ({model.config.model_type}) · {model.config.num_layers} layers · "
               f"{model.device.type} · {str(model.dtype).removeprefix('torch.')} · weights{mode} "
               f"{weights_text(weights)}"
               " · decode: " + ("native step" if acc.decode is not None else "PyTorch forward"),
               help=None if acc.decode is not None else acc.why_not)
    ss = session()
    if ss.model_notice is not None:
        st.info(ss.model_notice)
        ss.model_notice = None


def _show_load(box, state: LoadState, demo_waits: bool) -> None:
    box.progress(state.fraction, text=f"Loading the model: {plain(state.message)} ({state.fraction:.0%}, "
                 f"{state.seconds:.0f} s). " + ("Your demo starts as soon as it is ready." if demo_waits else
                                                "Run is enabled as soon as it is ready."))


def wait_for_model() -> LoadState:
    """Wait for the chosen model's load, showing its progress (in the sidebar's box if it drew one); then, if the
    sidebar was drawn without the model, draw the app again (st.rerun). Each update is a point where a click or
    a closed tab ends this script run."""
    drawn = _LOAD_BOX.get()
    box, demo_waits = drawn if drawn is not None else (st.sidebar.empty(), False)
    state = chosen_load()
    while state.loading:
        _show_load(box, state, demo_waits)
        time.sleep(LOAD_POLL_S)
        state = chosen_load()
    if drawn is not None:
        st.rerun()
    box.empty()
    return state


def finish_load() -> None:
    """After the page (app.py), and before a page stops early: if the sidebar was drawn while the model loaded,
    wait for it and draw the app again."""
    if _LOAD_BOX.get() is not None:
        wait_for_model()


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


def with_script_context(thread) -> None:
    """A thread working for this script run (a live run's) carries its context (the queue's per-browser turns
    read it)."""
    ctx = get_script_run_ctx(suppress_warning=True)
    if ctx is not None:
        add_script_run_ctx(thread, ctx)


def current_run() -> Trace | None:
    """The run the pages show (SessionState.run)."""
    return session().run


def keep_within_budget() -> None:
    """Hold this session to its memory budget; say what was dropped to make room. app.py calls it once, when
    the page has run, so what the script just kept (a run, a map) counts at once; a walk over a session's
    data costs ~16 ms with a 1,000-position run of a 30-layer model, so it is not repeated per current_run."""
    limits = server_limits(show_error=False)
    dropped = enforce(session(), data_allowance(limits.max_session_mb), widgets=st.session_state)
    if dropped:
        trim()
        st.toast(f"This session reached its memory budget ({limits.max_session_mb} MiB) and dropped: "
                 + "; ".join(dropped[:4]) + ("; …" if len(dropped) > 4 else "") + ". Recomputed when needed.")


def require_run() -> Trace:
    """The session's current run, or a hint to press Run (and the page stops there)."""
    run = current_run()
    if run is None:
        st.info("Enter a prompt in the sidebar and press **Run** to inspect a generation.")
        finish_load()
        st.stop()
    return run


def require_run_and_model(purpose: str = "inspect it"):
    """The current run and the loaded model it was made with; otherwise a message and the page stops."""
    run = require_run()
    model = get_model()
    if model is None:
        st.stop()
    if model.name != run.model_name:
        st.warning(f"This run was made with **{plain(run.model_name)}**; the sidebar now shows "
                   f"**{plain(model.name)}**. Choose that model in the sidebar (or press Run again) to {purpose}.")
        st.stop()
    try:      # a run from a trace file: the model work pages do on it stays within this server's limits
        check_run_positions(run.ids, model, server_limits(show_error=False))
    except LimitError as e:
        st.error(plain(e))
        st.stop()
    return run, model


def on_demand(store, k, what: str, compute, *, work: tuple | None = None, stop_on_error: bool = True, **bounds):
    """memo(store, k, ...): on a miss compute(on_progress) runs holding a device slot (queue shown), with a
    progress bar and a Stop button: the app's one way to show any long computation. on_progress takes the
    engine's one progress record (engine.progress: a forward's layers, or a job's units with what it is doing);
    the bar never moves back (a job's total is an upper bound until its end). work = (model, positions, layers)
    adds the time it should take, when this model's speed at this kind of computation was measured here
    (inspector.session.on_demand).

    Stop: the click asks Streamlit for a rerun, which ends this script at its next st call (the next progress
    update: the next layer, rerun or packed call), releasing the slot on the way out; the new run finds the
    computation marked in SessionState.stopped (the engine is answered STOP too, should the old run still be reporting,
    and a job raises engine.progress.Stopped before its next unit) and shows "Stopped" with a button to compute
    again. Nothing half-computed is memoised. Returns None while stopped, and after an engine error when
    stop_on_error is False (the message is shown; otherwise the script stops there)."""
    tag = _tag(what, k)
    stopped = session().stopped                                   # tag -> "stopped" | "again"
    if k in store:
        stopped.pop(tag, None)
        return memo(store, k, compute, **bounds)
    if stopped.get(tag) == "stopped":
        return _show_stopped(what, tag, stopped)
    model = work[0] if work else None
    est = about(estimate(model, what, *work[1:])) if work else ""
    last: list[Progress] = []
    shown = [0.0]

    def tell(p: Progress):
        if stopped.get(tag) == "stopped":
            return STOP
        last[:] = [p]
        shown[0] = max(shown[0], min(max(p.fraction, 0.0), 1.0))
        bar.progress(shown[0], text=f"Computing {what}: {p.what or progress_text(p)}"
                     + (f" ({est} in all)" if est else ""))
        return None
    try:
        with device_slot(what):
            bar = st.progress(0.0, text=f"Computing {what}" + (f" ({est})" if est else "") + "…")
            button = st.empty()
            button.button("Stop", key=f"od_stop_{tag}", on_click=stopped.__setitem__, args=(tag, "stopped"))
            t0 = time.perf_counter()
            try:
                value = memo(store, k, lambda: compute(tell), **bounds)
            finally:
                trim()              # its working tensors go back to the system, not to this thread's arena
                bar.empty()
                button.empty()
            stopped.pop(tag, None)
            if model is not None:
                record_rate(model, what, time.perf_counter() - t0, last[0] if last else None)
            return value
    except Stopped:
        stopped[tag] = "stopped"
        return _show_stopped(what, tag, stopped)
    except EngineError as e:
        st.error(str(e))
        if stop_on_error:
            st.stop()
        return None


def was_stopped(what: str, k) -> bool:
    """Whether a Stop ended on_demand(..., k, what, ...) and it was not computed since: a page that computes
    only on its own button calls on_demand then anyway (it shows "Stopped", or computes after "Compute again")."""
    return _tag(what, k) in session().stopped


def _tag(what: str, k) -> str:
    return hashlib.sha256(repr((what, k)).encode()).hexdigest()[:12]


def _show_stopped(what: str, tag: str, stopped: dict) -> None:
    st.warning(f"Stopped: {what} was not computed.")
    st.button("Compute again", key=f"od_again_{tag}", on_click=stopped.__setitem__, args=(tag, "again"))


_PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
# Streamlit's renderer (remark-gfm) finds bare links in the text *after* escapes are resolved, with
# /(https?:\/\/|www(?=\.))/ and /[-.\w+]+@[-\w]+(\.[-\w]+)+/: a zero-width space breaks each pattern
_AUTOLINK = re.compile(r"(?<=:)(?=//)|(?<=www)(?=\.)|(?=@)", re.IGNORECASE)
_ZWSP = "\u200b"


def plain(text: object) -> str:
    """Text from a file, a store or a browser (a run's model name and notes, a prompt, a token, a typed
    stage) made safe inside Markdown (st.markdown, st.caption, st.warning, ...) so that it shows as the
    characters it is: every ASCII punctuation character is backslash-escaped (CommonMark allows it for each;
    no link, image, tag, emphasis or Streamlit :directive[...] can form), and a zero-width space goes into
    each http://, www. and name@host, which GitHub-flavoured Markdown would otherwise turn into a link."""
    text = _AUTOLINK.sub(_ZWSP, str(text))
    return "".join("\\" + c if c in _PUNCTUATION else c for c in text)


def greedy(base, tokens: int):
    """base (RunSettings: a page's prompt and seed) greedy (T = 0) for `tokens` new tokens, EOS ignored: the run a
    page's own check makes of the page's prompt (the determinism check, steering)."""
    return dataclasses.replace(base, max_new_tokens=tokens, params=SamplingParams(temperature=0), ignore_eos=True)
