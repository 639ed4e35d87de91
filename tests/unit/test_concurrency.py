"""Many sessions on one shared model: twenty threads through inspect_run (the pages' code path) give each its
single-user output; the admission queue bounds runs on the device and tells waiters their place; limits
come from the environment; no run outlives the session (or caller) holding it."""
from __future__ import annotations

import gc
import re
import threading
import time
import weakref
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine import RunSettings
from inspector.session.admission import Admission, ServerBusyError, shared_admission, slot
from inspector.session.limits import LIMITS, LimitError, Limits, LimitsConfigError, env_name
from inspector.session.models import model_choices, shared_model
from inspector.session.run import inspect_run, live_runs
from inspector.ui.state import session_of
from tests.concurrency import twenty_sessions

ROOT = Path(__file__).resolve().parents[2]


def test_twenty_concurrent_sessions_equal_their_single_user_runs(tiny_model):
    twenty_sessions(tiny_model)           # tests/concurrency.py; again and again in test_concurrency_soak.py


def test_runs_are_released_when_their_holders_go(tiny_model):
    gc.collect()
    base = live_runs()
    records = [inspect_run(tiny_model, RunSettings(prompt="hello", max_new_tokens=2, seed=i)) for i in range(5)]
    assert live_runs() == base + 5
    refs = [weakref.ref(r) for r in records]
    probes = [weakref.ref(r.recording) for r in records]
    del records
    gc.collect()
    assert all(r() is None for r in refs + probes)                  # nothing in inspector kept one
    assert live_runs() == base


def _sidebar_app():
    """The app's frame without the pages: the sidebar, its Run button, the session's runs."""
    from inspector.ui.sidebar import sidebar
    sidebar()


@pytest.mark.app
def test_a_session_keeps_at_most_max_runs_and_an_ended_session_keeps_none(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("LLM_INSPECTOR_MAX_RUNS_KEPT", "2")
    model_choices.clear()
    shared_model.clear()            # loaded before the first script run: the sidebar alone does not wait for a load
    shared_model(str(tiny_model_dir), "cpu", "auto")
    at = AppTest.from_function(_sidebar_app, default_timeout=120)
    at.run()
    refs = []
    for k in range(3):
        at.sidebar.text_area(key="sb_prompt").set_value(f"run {k}")
        at.sidebar.number_input(key="sb_max_new").set_value(2)
        at.sidebar.button(key="sb_run").click().run()
        assert not at.exception and not at.sidebar.error
        run = session_of(at.session_state).run
        refs.append(weakref.ref(run))
        if k == 0:    # what a page memoised for this run (keyed like inspector.views.attention.run_key)
            session_of(at.session_state).memos["att_maps"] = {((id(run), run.created), 3): "run 0's map",
                                                              ("other", 3): "kept"}
    assert [r.settings.prompt for r in session_of(at.session_state).runs] == ["run 1", "run 2"]
    assert session_of(at.session_state).memos["att_maps"] == {("other", 3): "kept"}
    del run
    gc.collect()
    assert refs[0]() is None and refs[1]() is not None              # the dropped run and its probe are gone
    history = at.sidebar.selectbox(key="sb_history")                 # the kept ones can be shown again
    assert len(history.options) == 2
    history.set_value(session_of(at.session_state).runs[0].created).run()
    assert session_of(at.session_state).run.settings.prompt == "run 1"
    del at, history                                                  # the session ends
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


# ---- admission ----------------------------------------------------------------------------------------------

def _hold(adm: Admission, entered: threading.Event, leave: threading.Event, **kw):
    with adm.slot(**kw):
        entered.set()
        leave.wait(10)


def test_admission_queues_first_come_first_served_and_reports_places():
    adm = Admission(1, 5, heartbeat_s=0.02)
    entered, leave = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(adm, entered, leave))
    holder.start()
    assert entered.wait(5)
    order, seen = [], {k: [] for k in range(3)}

    def waiter(k: int):
        with adm.slot(on_wait=seen[k].append):
            order.append(k)

    threads = []
    for k in range(3):
        threads.append(threading.Thread(target=waiter, args=(k,)))
        threads[-1].start()
        _until(lambda n=k + 1: adm.state().waiting == n)
    _until(lambda: all(seen[k] for k in range(3)))
    assert [seen[k][0] for k in range(3)] == [1, 2, 3]              # each told its place on arrival
    leave.set()
    for t in [holder, *threads]:
        t.join(10)
    assert order == [0, 1, 2]
    assert all(seen[k] == sorted(seen[k], reverse=True) for k in range(3))     # places only go down
    s = adm.state()
    assert (s.running, s.waiting, s.admitted, s.peak_running, s.peak_waiting) == (0, 0, 4, 1, 3)


def test_admission_full_queue_and_timeout_are_server_busy():
    adm = Admission(1, 1)
    entered, leave = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(adm, entered, leave))
    holder.start()
    assert entered.wait(5)
    t0 = time.monotonic()
    with pytest.raises(ServerBusyError, match=r"waited 0 s in the queue .*LLM_INSPECTOR_QUEUE_TIMEOUT_S"), \
            adm.slot(timeout=0.2):
        pass
    assert 0.15 < time.monotonic() - t0 < 5
    entered2, leave2 = threading.Event(), threading.Event()
    waiting = threading.Thread(target=_hold, args=(adm, entered2, leave2), kwargs={"timeout": 5})
    waiting.start()
    _until(lambda: adm.state().waiting == 1)
    with pytest.raises(ServerBusyError, match=r"The server is busy: 1 runs are generating and 1 are waiting.*"
                                              r"LLM_INSPECTOR_MAX_QUEUE=1.*Try again"), adm.slot():
        pass
    leave.set()
    holder.join(5)
    assert entered2.wait(5)
    leave2.set()
    waiting.join(5)
    assert adm.state().refused == 2 and adm.state().running == 0


def test_admission_cleans_up_after_errors_and_stops():
    adm = Admission(1, 3, heartbeat_s=0.02)
    with pytest.raises(RuntimeError), adm.slot():
        raise RuntimeError("run failed")
    assert adm.state().running == 0
    entered, leave = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(adm, entered, leave))
    holder.start()
    assert entered.wait(5)

    class Stop(BaseException):       # what Streamlit raises in a script whose user left or pressed Stop
        pass

    def stop(position):
        raise Stop()

    with pytest.raises(Stop), adm.slot(on_wait=stop):
        pass
    assert adm.state().waiting == 0
    leave.set()
    holder.join(5)
    with adm.slot():
        assert adm.state().running == 1
    adm.configure(3, 0)
    with adm.slot(), adm.slot(), adm.slot():
        assert adm.state().running == 3
        with pytest.raises(ServerBusyError), adm.slot():
            pass


def test_shared_admission_and_slot_follow_the_environment(monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_MAX_CONCURRENT_RUNS", "3")
    monkeypatch.setenv("LLM_INSPECTOR_MAX_QUEUE", "7")
    adm = shared_admission()
    assert (adm.max_concurrent, adm.max_queue) == (3, 7) and shared_admission() is adm
    with slot():
        assert adm.state().running == 1
    monkeypatch.delenv("LLM_INSPECTOR_MAX_CONCURRENT_RUNS")
    monkeypatch.delenv("LLM_INSPECTOR_MAX_QUEUE")
    assert (shared_admission().max_concurrent, shared_admission().max_queue) == (32, 32)     # Limits' defaults


def _until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


# ---- limits -------------------------------------------------------------------------------------------------

def test_limits_from_environment(monkeypatch):
    assert Limits.from_env({}) == Limits()
    env = {env_name("max_prompt_tokens"): "512", env_name("max_new_tokens"): " 64 ",
           env_name("max_runs_kept"): "1", env_name("queue_timeout_s"): "2.5", env_name("max_prompt_chars"): "1_000"}
    lim = Limits.from_env(env)
    assert (lim.max_prompt_tokens, lim.max_new_tokens, lim.max_runs_kept, lim.queue_timeout_s,
            lim.max_prompt_chars) == (512, 64, 1, 2.5, 1000)
    for name, raw, msg in [("max_new_tokens", "lots", "must be a whole number, got 'lots'"),
                           ("max_concurrent_runs", "0", "must be a number >= 1, got 0"),
                           ("max_queue", "-1", "must be a number >= 0, got -1"),
                           ("queue_timeout_s", "nan", "must be a number >= 1")]:
        with pytest.raises(LimitsConfigError, match=f"LLM_INSPECTOR_{name.upper()} {msg}"):
            Limits.from_env({env_name(name): raw})


def test_limits_are_enforced_before_any_device_work(tiny_model, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_MAX_NEW_TOKENS", "4")
    monkeypatch.setenv("LLM_INSPECTOR_MAX_PROMPT_TOKENS", "10")
    calls = []
    monkeypatch.setattr(type(tiny_model), "forward", lambda self, *a, **k: calls.append(1))      # device work
    with pytest.raises(LimitError, match=r"5 new tokens asked for; this server generates at most 4 per run "
                                         r"\(LLM_INSPECTOR_MAX_NEW_TOKENS\)"):
        inspect_run(tiny_model, RunSettings(prompt="hi", max_new_tokens=5))
    with pytest.raises(LimitError,
                       match=r"the prompt is \d+ tokens long .*at most 10 \(LLM_INSPECTOR_MAX_PROMPT_TOKENS\)"):
        inspect_run(tiny_model, RunSettings(prompt="one two three four five six seven eight nine ten eleven",
                                            chat=False, max_new_tokens=4))
    assert calls == []


def test_every_limit_is_documented_with_its_default():
    doc = (ROOT / "docs" / "CLASSROOM.md").read_text()
    for var, _, default, _ in Limits().table():
        row = re.search(rf"^\|\s*`{var}`\s*\|\s*([^|]+?)\s*\|", doc, re.MULTILINE)
        assert row, f"{var} is not in the limits table of docs/CLASSROOM.md"
        assert row.group(1).replace(" ", "") == default, f"{var}: documented default {row.group(1)} != {default}"
    assert set(LIMITS) == {f.lower().removeprefix("llm_inspector_") for f, *_ in Limits().table()}
