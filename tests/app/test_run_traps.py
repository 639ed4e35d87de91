"""Traps around a run (issue 21, items 2, 3 and 5), through the app (AppTest) on the tiny model:

- after any end of a run (stopped in the prefill, stopped after tokens, an error, a cancel in the queue) Run
  and the demos are enabled at once, without the user changing anything;
- a sidebar number outside its range (Top-k -5, Seed -1, ...) is said above Run, named with its range, and
  nothing runs with a value the user did not see;
- a click while this session's previous click still finishes waits for it and says so, and a run refused for
  it says "your previous click is still finishing", not "in another tab?"."""
from __future__ import annotations

import threading
import time

import pytest
from streamlit.runtime.pages_manager import PagesManager
from streamlit.testing.v1 import AppTest

import inspector.ui.turn as turn
from engine import RunSettings
from inspector.session.admission import ServerBusyError, shared_admission
from inspector.session.limits import Limits
from inspector.session.live_run import Cancelled, LiveRun, StillFinishing
from inspector.session.models import model_choices
from inspector.ui.state import session_of

PROMPT = "The capital of France is"
STOP_PREFILL = "Stopped during the prefill, before the first token: nothing to keep."


def fresh_app(monkeypatch, app_file, model_dir, **env) -> AppTest:
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(model_dir))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model_choices.clear()
    at = AppTest.from_file(str(app_file), default_timeout=300)
    at.run()
    assert not at.exception, at.exception
    return at


def sidebar_in_order(at: AppTest) -> list[tuple[str, object]]:
    """(element type, key or value) of the sidebar's elements, top to bottom."""
    out = []

    def walk(node) -> None:
        kids = getattr(node, "children", None)
        if isinstance(kids, dict):
            for i in sorted(kids):
                walk(kids[i])
        else:
            out.append((node.type, getattr(node, "key", None) or getattr(node, "value", None)))
    walk(at.sidebar)
    return out


def texts(elements) -> list[str]:
    return [e.value for e in elements]


# ---- item 2: Run is enabled after any end of a run ----------------------------------------------------------

def _stopped_in_prefill(model) -> LiveRun:
    live = LiveRun(RunSettings(prompt=PROMPT, max_new_tokens=3), model.name, 0)
    live.stop()                           # Stop pressed before the first layer reported: the engine ends there
    return live.start(model, Limits.from_env())


class _StopAfterFirst(list):
    """LiveRun.pieces that presses Stop as the first token arrives (the engine checks it right after)."""

    def __init__(self, live: LiveRun) -> None:
        super().__init__()
        self.live = live

    def append(self, piece) -> None:
        super().append(piece)
        self.live.stop()


def _stopped_after_tokens(model) -> LiveRun:
    live = LiveRun(RunSettings(prompt=PROMPT, max_new_tokens=6), model.name, 0)
    live.pieces = _StopAfterFirst(live)
    return live.start(model, Limits.from_env())


def _engine_error(model) -> LiveRun:
    return LiveRun(RunSettings(prompt="   ", max_new_tokens=3), model.name, 0).start(model, Limits.from_env())


def _cancelled_in_queue(model) -> LiveRun:
    """The only slot held by another browser; Stop is pressed while the run waits for it."""
    held, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with shared_admission(Limits.from_env()).slot(client="another browser"):
            held.set()
            leave.wait(30)
    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    live = LiveRun(RunSettings(prompt=PROMPT, max_new_tokens=3), model.name, 0, client="this browser")
    live.stop()
    live.start(model, Limits.from_env())
    live.wait(30)
    leave.set()
    holder.join(10)
    return live


ENDS = [("stopped in the prefill", _stopped_in_prefill, "info", STOP_PREFILL, False),
        ("stopped after tokens", _stopped_after_tokens, "info", "Stopped after 1 tokens; the run is kept as it was.",
         True),
        ("an engine error", _engine_error, "error", "the prompt is empty (only whitespace)", False),
        ("cancelled in the queue", _cancelled_in_queue, "info", "Stopped while waiting in the queue: nothing was run.",
         False)]


@pytest.mark.parametrize("make,kind,said,kept", [e[1:] for e in ENDS], ids=[e[0] for e in ENDS])
def test_run_is_enabled_after_any_end_of_a_run(monkeypatch, app_file, tiny_model_dir, tiny_model, make, kind, said,
                                               kept):
    """The script run that finds the run going (the rerun a Stop click makes, a page change) draws Run and the
    demos disabled, watches the run end, and must not leave them so."""
    at = fresh_app(monkeypatch, app_file, tiny_model_dir, LLM_INSPECTOR_MAX_CONCURRENT_RUNS="1")
    live = make(tiny_model)
    session_of(at.session_state).live = live
    at.run()
    assert not at.exception, at.exception
    assert live.done and session_of(at.session_state).live is None
    assert texts(getattr(at.sidebar, kind)) == [said]
    assert not at.sidebar.button(key="sb_run").disabled
    demos = [b for b in at.sidebar.button if b.key.startswith("sb_demo_")]
    assert len(demos) == 3 and not any(b.disabled for b in demos)
    run = session_of(at.session_state).run
    assert (run is not None) == kept
    if kept:
        assert run.result.stop_reason == "stopped" and len(run.result.token_ids) == 1
    at.run()                                          # said once: the next script run says nothing of it
    assert said not in texts(getattr(at.sidebar, kind))
    assert not at.sidebar.button(key="sb_run").disabled


def test_cancelled_fixture_really_waited_in_the_queue(tiny_model, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_MAX_CONCURRENT_RUNS", "1")
    live = _cancelled_in_queue(tiny_model)
    assert isinstance(live.error, Cancelled) and live.first_position == 1 and live.record is None


# ---- item 3: an out-of-range number is said above Run, and runs nothing -------------------------------------

BAD = [("sb_top_k", -5, "Top-k must be between 0 and 1,000, got -5"),
       ("sb_seed", -1, "Seed must be between 0 and 2,147,483,647, got -1"),
       ("sb_max_new", 0, "Max new tokens must be between 1 and 8, got 0"),
       ("sb_no_repeat_ngram", 11, "No-repeat n-gram must be between 0 and 10, got 11"),
       ("sb_top_k", 1001, "Top-k must be between 0 and 1,000, got 1,001")]


@pytest.mark.parametrize("key,value,message", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_an_out_of_range_number_is_said_above_run_and_nothing_runs(monkeypatch, app_file, tiny_model_dir, key, value,
                                                                    message):
    at = fresh_app(monkeypatch, app_file, tiny_model_dir, LLM_INSPECTOR_MAX_NEW_TOKENS="8")
    at.sidebar.number_input(key=key).set_value(value).run()
    assert at.sidebar.number_input(key=key).value == value          # the box keeps what the user typed
    shown = f"{message}. Run starts nothing until it is corrected (Generation settings)."
    assert texts(at.sidebar.error) == [shown]
    order = sidebar_in_order(at)
    assert order.index(("error", shown)) < order.index(("button", "sb_run"))          # above Run
    at.sidebar.button(key="sb_run").click().run()
    assert not at.exception, at.exception
    assert session_of(at.session_state).run is None and session_of(at.session_state).live is None   # nothing ran
    assert texts(at.sidebar.error) == [shown]
    # corrected: the run uses exactly the values the boxes show
    good = {"sb_top_k": 5, "sb_seed": 7, "sb_max_new": 2, "sb_no_repeat_ngram": 3}
    for k, v in good.items():
        at.sidebar.number_input(key=k).set_value(v)
    at.sidebar.button(key="sb_run").click().run()
    assert not at.exception and not at.sidebar.error
    s = session_of(at.session_state).run.settings
    assert (s.params.top_k, s.seed, s.max_new_tokens, s.params.no_repeat_ngram) == (5, 7, 2, 3)


def test_two_bad_numbers_are_both_named_in_the_order_of_their_boxes(monkeypatch, app_file, tiny_model_dir):
    at = fresh_app(monkeypatch, app_file, tiny_model_dir)
    at.sidebar.number_input(key="sb_seed").set_value(-1)
    at.sidebar.number_input(key="sb_top_k").set_value(-5).run()
    assert [e.split(" must")[0] for e in texts(at.sidebar.error)] == ["Top-k", "Seed"]


def test_the_debugger_refuses_a_bad_sidebar_setting_by_name(monkeypatch, app_file, tiny_model_dir):
    """Pages that start runs from the sidebar's settings refuse them too (settings_from_sidebar)."""
    at = fresh_app(monkeypatch, app_file, tiny_model_dir)
    at.switch_page("views/debugger.py").run()
    at.sidebar.number_input(key="sb_seed").set_value(-1).run()     # typed while the Debugger is open
    at.button(key="dbg_step").click().run()
    assert not at.exception, at.exception
    assert "Could not start the run: Seed must be between 0 and 2,147,483,647, got -1" in texts(at.main.error)
    assert session_of(at.session_state).run is None


# ---- item 5: a click while the previous click still finishes --------------------------------------------------

def _hold_turn(at: AppTest, seconds: float) -> threading.Thread:
    """Another script run of this session (the previous click) holds its turn for `seconds`."""
    turn = session_of(at.session_state).turn
    held = threading.Event()

    def previous_click() -> None:
        with turn:
            held.set()
            time.sleep(seconds)
    t = threading.Thread(target=previous_click)
    t.start()
    assert held.wait(5)
    return t


def test_a_click_waits_for_the_previous_click_then_runs(monkeypatch, app_file, tiny_model_dir):
    at = fresh_app(monkeypatch, app_file, tiny_model_dir)
    assert at.header[0].value == "Overview"
    t = _hold_turn(at, 1.5)
    t0 = time.monotonic()
    at.run()
    waited = time.monotonic() - t0
    t.join()
    assert not at.exception, at.exception
    assert waited >= 1.0                                            # the page waited for the previous click…
    assert at.header and at.header[0].value == "Overview"           # …then drew itself
    assert not at.main.warning


def test_a_click_says_the_previous_click_is_still_finishing(monkeypatch, app_file, tiny_model_dir):
    monkeypatch.setattr(turn, "PREVIOUS_WAIT_S", 0.5)
    at = fresh_app(monkeypatch, app_file, tiny_model_dir)
    t = _hold_turn(at, 4.0)
    at.run()
    assert not at.exception, at.exception
    assert texts(at.main.warning) == ["Your previous click is still finishing; try again in a moment."]
    assert not at.header                                            # the page did not run alongside it
    t.join()
    at.run()
    assert at.header[0].value == "Overview" and not at.main.warning


@pytest.mark.parametrize("previous_click_running", [True, False])
def test_a_run_refused_for_its_own_sessions_click_says_so(monkeypatch, tiny_model, previous_click_running):
    """One browser: a run generating and one waiting (the most it may have); a third is refused. When this
    session's previous click is what still runs, the run says so; otherwise the queue's own message stands."""
    monkeypatch.setenv("LLM_INSPECTOR_MAX_CONCURRENT_RUNS", "1")
    admission = shared_admission(Limits.from_env())
    held, queued, leave = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with admission.slot(client="browser:one"):
            held.set()
            leave.wait(30)

    def wait_behind() -> None:
        with admission.slot(on_wait=lambda n: queued.set(), client="browser:one"):
            pass
    threads = [threading.Thread(target=hold), threading.Thread(target=wait_behind)]
    threads[0].start()
    assert held.wait(10)
    threads[1].start()
    assert queued.wait(10)
    try:
        live = LiveRun(RunSettings(prompt=PROMPT, max_new_tokens=2), tiny_model.name, 0, client="browser:one",
                       previous_click=lambda: previous_click_running).start(tiny_model, Limits.from_env())
        assert live.wait(30)
    finally:
        leave.set()
        for t in threads:
            t.join(10)
    assert isinstance(live.error, ServerBusyError) and live.record is None
    if previous_click_running:
        assert isinstance(live.error, StillFinishing)
        assert str(live.error) == "Your previous click is still finishing; try again in a moment."
    else:
        assert not isinstance(live.error, StillFinishing)
        assert str(live.error).startswith("You already have 1 run(s) generating and 1 waiting (in another tab?)")
