"""The sidebar every page shares: the prompt and Run first (inside a 1280×720 screen), a live view of the run (prefill
by chunk and layer, tokens as they come, an estimate from this server's measured speed, Stop), then the model, device,
dtype, generation settings, demos and the runs kept. A run is checked against the server's limits and waits for a
device slot (a waiting user sees their place in the queue), then generates in a thread of its own (inspector.session.
live_run) so that Stop and page changes work; Stop takes Run's place meanwhile. The run (engine.Trace) lives in this
session's SessionState only; when it ends, the app is drawn again (Run and the demos enabled). A number outside its
range is named above Run, and Run starts nothing until it is corrected. One click at a time per session draws its page
(inspector.ui.turn, app.py). While the model loads (a fresh server's first visitors), the sidebar shows its progress,
Run waits.
"""
from __future__ import annotations

import time
from contextlib import suppress

import streamlit as st
import torch
from streamlit.runtime.scriptrunner import get_script_run_ctx
from streamlit.runtime.scriptrunner_utils.exceptions import StopException

from engine import EngineError, InputError, Model, RunSettings, SamplingParams, Trace
from engine.generate import prompt_ids
from inspector.session.admission import shared_admission
from inspector.session.estimate import Estimate, prefill_left
from inspector.session.limits import LimitError, Limits, check_int, env_name
from inspector.session.live_run import Cancelled, LiveRun, StillFinishing, rates
from inspector.session.model_choices import QUANT_LABELS, is_gguf
from inspector.session.models import model_choices
from inspector.session.run import check_settings, generations, live_runs
from inspector.session.server_memory import server_memory
from inspector.ui import common, demos, room_live, st_internals
from inspector.ui.common import client_key, current_run, get_model, log, plain, server_limits
from inspector.ui.room_sync import following
from inspector.ui.state import session
from inspector.ui.turn import page_turn
from inspector.ui.widgets import PROJECTOR, navigation_links, sampler_problems, sampling_params_from, sampling_widgets

LONG_S = 20.0                # runs estimated longer than this say so before they start
SEED_MAX = 2**31 - 1


def sidebar(app_pages: list | None = None) -> Model | None:
    """The sidebar; app_pages: app.py's st.Page objects, linked at its top (inspector.ui.widgets.navigation_links)."""
    sb = st.sidebar
    limits = server_limits()
    top = sb.container()                          # drawn first on screen, filled once the model is known
    with sb.container():
        navigation_links(app_pages)
    sb.toggle("Chat format", value=True, key="sb_chat")
    sb.toggle("Projector mode", key=PROJECTOR, on_change=_projector_url,
              help="Big type, thick lines, high contrast, one chart per row (also: add ?projector=1 to the URL)")
    live: LiveRun | None = session().live
    if not following():      # a student following a room runs nothing: fewer widgets to redraw on each change
        settings_widgets(limits, live)
    model = get_model(wait=False)       # while it loads: the app now, its progress under the title
    with top:
        live, run_slot = prompt_and_run(model, limits, live)
    history(limits)
    run = current_run()
    for note in (run.notes if run is not None else []):
        sb.warning(plain(note))       # a run's notes may come from a file: shown as the characters they are
    footer = sb.empty()
    server_footer(footer, limits)
    if live is not None:              # the run is watched once the whole sidebar is drawn: the footer counts it
        with top:
            watch(live, limits, run_slot, on_tick=lambda: server_footer(footer, limits))
    return model


def server_footer(slot, limits: Limits) -> None:
    a = shared_admission(limits).state()
    # what the server holds, every session together: why a model was unloaded to make room, or refused
    slot.caption(f"Server: {a.running} of {a.max_concurrent} run slots busy · {a.waiting} waiting · "
                 f"{live_runs()} runs in memory · model generations: {generations()}  \n"
                 + plain(server_memory(limits).caption()))      # model names come from folder names


def settings_widgets(limits: Limits, live: LiveRun | None) -> None:
    """The model, device, dtype and generation settings, and the demos."""
    with st.sidebar.expander("Model and device"):
        choices = model_choices()
        label = st.selectbox("Model", list(choices), key="sb_model")
        if is_gguf(choices.get(label, next(iter(choices.values())))):
            st.selectbox("Weights", list(QUANT_LABELS), key="sb_quant",
                         help="A GGUF file: its matrices dequantised to floats (the device and dtype below), or "
                              "kept in the file's own blocks and multiplied by them (CPU, float32).")
        c1, c2 = st.columns(2)
        c1.selectbox("Device", ["auto", "cpu"] + (["cuda"] if torch.cuda.is_available() else []), key="sb_device")
        c2.selectbox("Dtype", ["auto", "float32", "bfloat16", "float16"], key="sb_dtype")
    with st.sidebar.expander("Generation settings"):
        # no bounds in the browser (it would keep an out-of-range value to itself): generation_problems says
        st.number_input("Max new tokens", value=min(32, limits.max_new_tokens), step=1, key="sb_max_new",
                        help=f"At least 1, at most {limits.max_new_tokens:,} on this server.")
        sampling_widgets("sb", SamplingParams())
        st.number_input("Seed", value=0, step=1, key="sb_seed", help=f"A whole number from 0 to {SEED_MAX:,}.")
        st.toggle("Special-token text in the prompt acts as control tokens", value=False, key="sb_allow_special")
    with st.sidebar.expander("Demos: one click, one lesson"):
        demos.demo_buttons("sb_demo", columns=False, disabled=live is not None)


def _projector_url() -> None:
    if st.session_state.get(PROJECTOR):
        st.query_params["projector"] = "1"
    else:
        st.query_params.pop("projector", None)


def prompt_and_run(model: Model | None, limits: Limits, live: LiveRun | None) -> tuple[LiveRun | None, object]:
    """Title, model, prompt, Run, the estimate; the live run (started here on a click) for the caller to watch, and
    Run's slot, where Stop takes its place while a run goes (never a Run that looks clickable above Stop)."""
    st.markdown("**LLM Inspector** · see inside a language model")
    if model is None:            # loading (a demo clicked meanwhile waits for it) or failed
        common.load_box(demo_waits=session().demo is not None)
    else:
        common.model_line(model)
    follows = following()        # a student following a room's teacher never starts a generation
    state, ss = st.session_state, session()
    if follows:                  # the teacher's prompt and settings; the student's own prompt is kept for later
        ss.own_prompt = state.get("sb_prompt", ss.own_prompt)
        room_live.teacher_prompt(height=100)
    else:
        if "sb_prompt" not in state and isinstance(ss.own_prompt, str):
            state["sb_prompt"] = ss.own_prompt
        # No max_chars: Streamlit's box drops a change past max_chars without a word (a 50,000-character paste left
        # the box as it was, and Run then ran the old prompt). The box takes any paste; the length is checked below,
        # said with the limit, and Run starts nothing until the prompt is shortened.
        st.text_area("Prompt", "What is the capital of France?", key="sb_prompt", height=100,  # same id each run
                     help=f"Up to {limits.max_prompt_chars:,} characters and {limits.max_prompt_tokens:,} tokens. "
                          "Tab, newline and carriage return are the only control characters accepted.")
    typed = st.session_state.get("sb_prompt")
    too_long = not follows and isinstance(typed, str) and len(typed) > limits.max_prompt_chars
    if too_long:
        st.error(f"The prompt is {len(typed):,} characters long; this server accepts at most "
                 f"{limits.max_prompt_chars:,} ({env_name('max_prompt_chars')}). Shorten it: Run starts nothing until "
                 "then.")
    asked = st.session_state.get("sb_max_new")
    if isinstance(asked, (int, float)) and asked > limits.max_new_tokens:
        st.warning(f"Max new tokens: {asked:,} is more than this server generates per run "
                   f"({limits.max_new_tokens:,}, {env_name('max_new_tokens')}); Run generates at most "
                   f"{limits.max_new_tokens:,}.")
    problems = [] if follows else generation_problems() + (["The prompt is too long"] if too_long else [])
    for problem in problems[:len(problems) - too_long]:     # the box may sit in a collapsed expander: said here
        st.error(f"{problem}. Run starts nothing until it is corrected (Generation settings).")
    # Run's slot, Stop's while a run goes (watch). Run sits in a block: the browser keeps showing a widget of the last
    # script run that another element replaced until the script run ends (a click's: the run's end); a block goes.
    # The click is taken from Run's callback, which runs before this script run draws anything: so the click's own
    # script run draws Run greyed, the same button in the same place (its key is its identity), until Stop replaces
    # it. (Drawn enabled, as the button's return value would have it, Run stayed clickable while the run started.)
    run_slot, off = st.empty(), model is None or follows
    pressed, ss.run_pressed = ss.run_pressed, False         # a click during a run is dropped: Stop is in its place
    demo = None
    if not follows and model is not None:
        demo, ss.demo = ss.demo, None
    starts = live is None and model is not None and not follows and (pressed or demo is not None) and not problems
    if live is None:
        run_slot.container().button("Run", type="primary", key="sb_run", disabled=off or starts,
                                    on_click=press_run, use_container_width=True)
    if follows:
        st.caption("Following the teacher's room: press **Explore on my own** above the page to run your own.")
        if live is None:
            return None, run_slot
    notices, ss.notices = ss.notices, []
    for kind, text in notices:   # the end of the run a previous script run watched
        getattr(st, kind)(text)
    if starts:
        live = start_run(model, limits, demo)
        if live is None:         # refused (said in notices): Run is drawn again, enabled, by a new script run
            st.rerun()
        run_slot.empty()         # Stop takes Run's place once the sidebar is drawn
    elif live is None and model is not None and not problems:
        estimate_caption(model, limits)          # the widgets were checked above (problems): not again
    return live, run_slot


def press_run() -> None:
    """Run's callback: Streamlit calls it once per click, before the click's script run draws the sidebar."""
    session().run_pressed = True


def generation_problems() -> list[str]:
    """The sidebar's generation numbers outside their ranges, in the order of their boxes, each named with its
    range: values that would otherwise be replaced without a word (Streamlit keeps a bounded widget's old
    value) or refused by the engine. Max new tokens above the server's limit is not one: that is said above
    Run, and the run generates at the limit."""
    limit = server_limits(show_error=False).max_new_tokens
    asked = st.session_state.get("sb_max_new")
    if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked > limit and float(asked).is_integer():
        asked = limit
    return (_whole_number(asked, "sb_max_new", "Max new tokens", 1, limit) + sampler_problems("sb")
            + _whole_number(st.session_state.get("sb_seed"), "sb_seed", "Seed", 0, SEED_MAX))


def _whole_number(value, key: str, what: str, lo: int, hi: int) -> list[str]:
    if key not in st.session_state:
        return []
    try:
        check_int(value, lo, hi, what)
    except LimitError as e:
        return [str(e)]
    return []


def settings_from_sidebar(*, checked: bool = False) -> RunSettings:
    """The sidebar's prompt and settings; InputError names the first setting outside its range (checked=True: the
    caller has just found no problem in this script run, generation_problems, and they are not looked for again)."""
    problems = [] if checked else generation_problems()
    if problems:
        raise InputError(problems[0])
    s = st.session_state
    limit = server_limits(show_error=False).max_new_tokens
    return RunSettings(prompt=s["sb_prompt"], chat=s["sb_chat"], max_new_tokens=min(int(s["sb_max_new"]), limit),
                       params=sampling_params_from("sb"), seed=int(s["sb_seed"]),
                       allow_special=bool(s["sb_allow_special"]))


def _prompt_tokens(model: Model, settings: RunSettings, limits: Limits) -> int | None:
    """Prompt tokens as the model will see them (memoised per prompt text and format); None if invalid. A prompt
    over the server's length limit is never tokenized (a browser can send megabytes whatever max_chars says)."""
    if not isinstance(settings.prompt, str) or len(settings.prompt) > limits.max_prompt_chars:
        return None
    memo, key = session().prompt_tokens, _tokens_key(model, settings)
    if key not in memo:
        memo.clear()
        try:
            memo[key] = len(prompt_ids(model, settings.prompt, chat=settings.chat,
                                       allow_special=settings.allow_special))
        except EngineError:
            memo[key] = None
    return memo[key]


def _tokens_key(model: Model, settings: RunSettings) -> tuple:
    return model.name, settings.prompt, settings.chat, settings.allow_special


def _estimate(model: Model, settings: RunSettings, limits: Limits) -> Estimate | None:
    n = _prompt_tokens(model, settings, limits)
    return None if n is None else rates(model).forecast(n, settings.max_new_tokens)


def estimate_caption(model: Model, limits: Limits) -> None:
    with suppress(TypeError, ValueError, InputError):       # a setting out of range: said above Run instead
        if (est := _estimate(model, settings_from_sidebar(checked=True), limits)) is not None:
            st.caption(est.caption())


def start_run(model: Model, limits: Limits, demo: str | None) -> LiveRun | None:
    """Check the settings here (a bad prompt is said at once: in notices, for the script run that draws Run again),
    then generate in the background."""
    try:
        settings = settings_from_sidebar(checked=True)     # prompt_and_run starts a run only without problems
    except (TypeError, ValueError, InputError) as e:
        session().notices.append(("error", f"Invalid generation setting: {e}"))
        return None
    try:
        checked = check_settings(model, settings, limits)     # the one check and tokenisation of this Run
    except EngineError as e:
        session().notices.append(("error", str(e)))
        return None
    n_prompt = len(checked.prompt_ids)
    session().prompt_tokens.clear()
    session().prompt_tokens[_tokens_key(model, settings)] = n_prompt     # the estimate after the run: not again
    est = rates(model).forecast(n_prompt, checked.settings.max_new_tokens)
    turn = page_turn()
    live = LiveRun(settings, model.name, n_prompt, None if est is None else est.total, demo=demo,
                   client=client_key(), previous_click=turn.locked,
                   observer=room_live.publisher(settings.prompt, settings.max_new_tokens))   # a teacher's room
    session().live = live
    return live.start(model, limits, prepare=common.with_script_context, checked=checked)


def watch(live: LiveRun, limits: Limits, slot, on_tick=None) -> None:
    """Show the run until it ends (Stop, in Run's slot, ends it early), then keep it and draw the app again (the page
    was drawn for a running run). What the end said is kept for that next run (notices)."""
    try:
        stop, note = slot, st.empty()           # gone once the run has ended
        stop.button("Stop", key="sb_stop", on_click=live.stop, use_container_width=True,
                    help="End the run after the current layer or token; what it made so far is kept")
        if live.estimate_s is not None and live.estimate_s > LONG_S:
            note.info(f"This run will take about {live.estimate_s:,.0f} s on this server (prompt of "
                      f"{live.n_prompt:,} tokens). Its progress shows below; Stop keeps what it has made so far.")
        bar, box, text = st.progress(0.0, text="starting"), st.empty(), st.empty()
        while not live.done:
            _draw(live, bar, box, text)
            if on_tick is not None:
                on_tick()             # the server footer, as the run takes its slot and others come and go
            live.wait(0.25)
    except StopException:
        if stopped_for_good():   # nobody watches any more: the run ends at its next layer or token, its slot is
            live.stop()          # free at once, and the next click keeps it (a rerun's new script run watches on)
        raise
    for placeholder in (stop, note, bar, box, text):
        placeholder.empty()
    session().live = None
    session().notices, kept = finish(live, limits)
    if kept is not None and live.demo:
        demos.after_run(live.demo)            # opens the demo's page: a new script run
    st.rerun()


def stopped_for_good(settle_s: float = 0.2) -> bool:
    """Whether this script run's StopException is the toolbar's Stop (or the session's end), not a rerun: with fast
    reruns a rerun or page change stops the script alike, but gives the session a new ScriptRunner just after (hence
    the settle). Through inspector.ui.st_internals (False where its internals are not there: the run goes on)."""
    return st_internals.stopped_for_good(get_script_run_ctx(suppress_warning=True), settle_s)


def _draw(live: LiveRun, bar, box, text) -> None:
    now = time.monotonic()
    if live.admitted_at is None and live.queue_position is not None and live.previous_click and live.previous_click():
        bar.progress(0.0, text="waiting for your previous click")
        box.info("Your previous click is still finishing; this run starts as soon as it has.")
        return
    if live.admitted_at is None and live.queue_position is not None:
        bar.progress(0.0, text=f"waiting: number {live.queue_position} in the queue")
        box.info(f"The server is busy. You are number {live.queue_position} in the queue; your run starts as "
                 "soon as a slot is free.")
        return
    box.empty()
    max_new = live.settings.max_new_tokens
    if live.tokens == 0 and live.prefill is not None:
        p, (c, n) = live.prefill, live.prefill.chunks
        left = prefill_left(p, now - (live.admitted_at or now), live.shape)   # later chunks attend to more
        bar.progress(min(1.0, p.fraction), text=f"prefill {p.fraction:.0%}: positions {p.done:,}–{p.chunk_end:,} of "
                     f"{p.total:,} (chunk {c} of {n}), layer {min(p.layer + 1, p.layers)} of {p.layers}"
                     + ("" if left is None else f" · about {left:,.0f} s left"))
    elif live.tokens:
        rate = (live.tokens - 1) / max(1e-9, (live.last_token_at or now) - (live.decode_from or now))
        bar.progress(min(1.0, live.tokens / max_new), text=f"token {live.tokens} of at most {max_new}"
                     + (f" · {rate:.1f} tokens/s" if live.tokens > 2 else ""))
        text.code(live.text, language=None, wrap_lines=True)


def finish(live: LiveRun, limits: Limits) -> tuple[list[tuple[str, str]], Trace | None]:
    """Keep the finished run; what to say about its end, as (st function, text) pairs, and the run kept."""
    e, record = live.error, live.record
    live.record = live.error = None           # a stale Stop callback keeps the LiveRun, never the run
    if isinstance(e, Cancelled):
        return [("info", "Stopped while waiting in the queue: nothing was run.")], None
    if isinstance(e, StillFinishing):
        return [("warning", str(e))], None
    if isinstance(e, EngineError):
        return [("error", str(e))], None
    if e is not None:         # an engine bug: say so, keep the server and the model going
        log.error("run failed", exc_info=e)
        return [("error", f"The run failed unexpectedly ({type(e).__name__}: {e}). The model is still loaded; "
                          "please report this with the prompt and settings.")], None
    if record is None:        # another script run of this session, watching the same run, has kept it
        return [], None
    if not record.result.steps and record.result.stop_reason == "stopped":
        return [("info", "Stopped during the prefill, before the first token: nothing to keep.")], None
    keep_run(record, limits.max_runs_kept)
    said = []
    if live.waited_s is not None:
        said.append(("caption", f"This run waited {live.waited_s:.1f} s in the queue (it arrived as number "
                                f"{live.first_position}), then generated for {record.seconds:.1f} s."))
    if record.result.stop_reason == "stopped":
        said.append(("info", f"Stopped after {len(record.result.token_ids)} tokens; the run is kept as it was."))
    return said, record


def keep_run(record: Trace, max_runs: int) -> None:
    """Make record the current run; drop runs beyond max_runs, and what pages memoised for them."""
    session().keep(record, max_runs)


def history(limits: Limits) -> None:
    """With more than one kept run, a selectbox to show an earlier one."""
    ss = session()
    runs: list[Trace] = ss.runs
    if len(runs) < 2:
        return
    by_time = {r.created: r for r in runs}
    if ss.history_newest != runs[-1].created or st.session_state.get("sb_history") not in by_time:
        ss.history_newest = st.session_state["sb_history"] = runs[-1].created   # a new run shows
    labels = {r.created: f"{time.strftime('%H:%M:%S', time.localtime(r.created))} · {str(r.settings.prompt)[:30]!r} · "
                         f"{len(r.result.token_ids)} tokens" for r in runs}

    def show() -> None:    # only when the user picks: a run another page published stays current otherwise
        ss.show(by_time[st.session_state["sb_history"]])

    st.sidebar.selectbox(f"Run shown (this session keeps {limits.max_runs_kept})", list(reversed(by_time)),
                         format_func=labels.get, key="sb_history", on_change=show, disabled=following())
