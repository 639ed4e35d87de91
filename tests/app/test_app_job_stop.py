"""AppTest: the long jobs (the why-loop, activation patching, input attribution, the precision comparison) show
a progress bar and a Stop button while they run (inspector.ui.common.on_demand); a Stop, clicked while one runs, ends
it before its next unit of work, the page says "Stopped" and keeps nothing, and "Compute again" runs it whole.

A click cannot land mid-run in AppTest, so the unit of work is wrapped: the wrapper notes the Stop buttons on
the page at that moment and, at the chosen unit, does what the Stop button's on_click does (marks the job
stopped in SessionState.stopped). The job then hears STOP at its next progress record."""
from __future__ import annotations

import pytest

import engine.tools.patching as patching
import engine.tools.why_loop as why_loop_mod
from engine import RunSettings
from inspector.session.run import inspect_run
from inspector.ui.state import session_of
from tests.app.test_app_explain import page as explain_page  # noqa: F401  (a fixture)
from tests.app.test_app_explain import run  # noqa: F401  (a fixture)
from tests.app.test_app_prescribe import LOOP_PROMPT, looper, section  # noqa: F401  (looper: a fixture)

pytestmark = pytest.mark.app


def clicking_stop(monkeypatch, module, name: str, at: int | None) -> dict:
    """Wrap module.name (one unit of work): note the Stop buttons present when each unit starts, and before
    unit number `at` (from 1; None: never) click Stop as its on_click does. Returns the notes."""
    seen, fn = {"units": 0, "stop_buttons": []}, getattr(module, name)

    def unit(*a, **kw):
        import streamlit as st
        seen["units"] += 1
        keys = sorted(str(k) for k in st.session_state if str(k).startswith("od_stop_"))
        seen["stop_buttons"].append(keys)
        if seen["units"] == at:
            for k in keys:
                session_of(st.session_state).stopped[k.removeprefix("od_stop_")] = "stopped"
        return fn(*a, **kw)
    monkeypatch.setattr(module, name, unit)
    return seen


def stopped(at, what: str) -> bool:
    return [w.value for w in at.warning] == [f"Stopped: {what} was not computed."] \
        and "Compute again" in [b.label for b in at.button]


def test_the_why_loop_shows_stop_while_it_reruns_and_stopped_after(looper, monkeypatch):  # noqa: F811
    seen = clicking_stop(monkeypatch, why_loop_mod, "GenerationRun", at=2)
    run = inspect_run(looper, RunSettings(prompt=LOOP_PROMPT, chat=False, max_new_tokens=16))  # noqa: F811
    at = section("why_loop_section", run, looper).run()
    at.number_input(key="wl_budget").set_value(5).run()
    seen["units"], seen["stop_buttons"] = 0, []
    at.button(key="wl_run").click().run()
    assert not at.exception, at.exception
    assert seen["units"] == 2 and all(len(k) == 1 for k in seen["stop_buttons"])   # a Stop button at each rerun
    assert stopped(at, "the loop diagnosis") and not at.dataframe and not at.get("progress")
    assert not session_of(at.session_state).memos["wl_reports"]                      # nothing half-done kept
    at.run()                                                                         # still stopped, no rerun
    assert seen["units"] == 2 and stopped(at, "the loop diagnosis")
    next(b for b in at.button if b.label == "Compute again").click().run()
    assert not at.exception, at.exception
    assert seen["units"] == 2 + 5 and "period 3" in at.warning[0].value and at.dataframe
    assert not [b for b in at.button if b.label in ("Stop", "Compute again")] and not at.get("progress")


def test_patching_shows_stop_while_it_packs_and_stopped_after(explain_page, monkeypatch):  # noqa: F811
    seen = clicking_stop(monkeypatch, patching, "_run_pack", at=1)
    at = explain_page.run()
    assert not at.exception, at.exception
    at.button(key="ex_patch_run").click().run()
    assert not at.exception, at.exception
    assert seen["units"] == 1 and len(seen["stop_buttons"][0]) == 1
    assert stopped(at, "activation patching") and not at.get("progress")
    at.run()
    assert seen["units"] == 1 and stopped(at, "activation patching")
    next(b for b in at.button if b.label == "Compute again").click().run()
    assert not at.exception, at.exception
    assert seen["units"] > 2 and "Partial runs" in [m.label for m in at.metric]
    assert not [w for w in at.warning if w.value.startswith("Stopped")]


def test_input_attribution_shows_stop_and_stopped(explain_page, monkeypatch):  # noqa: F811
    seen = clicking_stop(monkeypatch, patching, "_run_pack", at=1)
    at = explain_page.run()
    at.button(key="ex_attr_run").click().run()
    assert not at.exception, at.exception
    assert seen["units"] == 1 and len(seen["stop_buttons"][0]) == 1
    assert stopped(at, "input attribution")
    next(b for b in at.button if b.label == "Compute again").click().run()
    assert not at.exception, at.exception
    assert any(m.label.startswith("Deletion area") for m in at.metric)


def test_the_precision_comparison_shows_stop_and_stopped(page, tiny_model, tiny_model_dir, monkeypatch):
    from engine.model import Model
    tiny_run = inspect_run(tiny_model, RunSettings(prompt="one two three four five six", max_new_tokens=2))
    at = page("nan_doctor", tiny_run, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    seen = clicking_stop(monkeypatch, Model, "_block", at=2)          # one unit: a block of either forward
    at.button(key="nd_prec_run").click().run()
    assert not at.exception, at.exception
    assert seen["units"] == 2 and all(len(k) == 1 for k in seen["stop_buttons"])
    assert stopped(at, "the precision comparison") and not session_of(at.session_state).memos["nd_precs"]
    next(b for b in at.button if b.label == "Compute again").click().run()
    assert not at.exception, at.exception
    assert seen["units"] == 2 + 2 * tiny_model.config.num_layers and session_of(at.session_state).memos["nd_precs"]
    assert {c.key for c in at.get("plotly_chart")} >= {"nd_prec_line", "nd_prec_heat"}
