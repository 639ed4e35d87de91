"""AppTest: the NaN doctor's fault run and the Repetition page's generations with each setting run through the
app's one progress + Stop mechanism (inspector.ui.common.on_demand): a Stop button while they run, a Stop ends
them before their next token, the page says "Stopped" and keeps nothing, and "Compute again" runs them whole.

As in test_app_job_stop: a click cannot land mid-run in AppTest, so the job's entry is wrapped; the wrapper notes
the Stop buttons on the page when it starts and, on the chosen call, does what the Stop button's on_click does.
The job hears STOP at its next progress record (the fault run: after its first token; the comparison: before
its first setting's generation) and raises engine.progress.Stopped."""
from __future__ import annotations

import pytest

import engine.tools.doctor as doctor
import inspector.views.repetition as rv
from engine import RunSettings
from inspector.session.run import inspect_run
from inspector.ui.state import session_of
from tests.app.test_app_job_stop import clicking_stop, stopped

pytestmark = pytest.mark.app


@pytest.fixture(scope="module")
def tiny_run(tiny_model):
    return inspect_run(tiny_model, RunSettings(prompt="one two three four five six", max_new_tokens=3))


def test_the_fault_run_shows_stop_and_stops_before_its_next_token(page, tiny_model, tiny_model_dir, tiny_run,
                                                                   monkeypatch):
    seen = clicking_stop(monkeypatch, doctor, "run_doctor", at=1)
    at = page("nan_doctor", tiny_run, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    at.selectbox(key="nd_preset").set_value("custom").run()       # a fault that stays finite: every token is drawn
    at.selectbox(key="nd_kind").set_value("zero").run()
    at.button(key="nd_inject").click().run()
    assert not at.exception, at.exception
    assert seen["units"] == 1 and len(seen["stop_buttons"][0]) == 1                # a Stop button during the run
    assert stopped(at, "the fault run") and not at.get("progress"), [w.value for w in at.warning]
    assert not session_of(at.session_state).memos["nd_reports"]                     # nothing half-done kept
    at.run()                                                                        # still stopped, no rerun
    assert seen["units"] == 1 and stopped(at, "the fault run")
    next(b for b in at.button if b.label == "Compute again").click().run()
    assert not at.exception, at.exception
    assert seen["units"] == 2 and len(session_of(at.session_state).memos["nd_reports"]) == 1
    (report,) = session_of(at.session_state).memos["nd_reports"].values()
    assert report.result.stop_reason == "max_new_tokens" and len(report.result.token_ids) == 3
    assert not [w for w in at.warning if w.value.startswith("Stopped")] and not at.get("progress")


def test_the_settings_comparison_shows_stop_and_stops_before_its_next_token(page, tiny_model, tiny_model_dir,
                                                                            tiny_run, monkeypatch):
    generated: list[int] = []
    generate = rv.generate

    def counting(model, *a, on_token=None, **kw):     # tokens drawn, across every setting's generation
        return generate(model, *a, on_token=lambda s: (generated.append(s.index), on_token(s))[1], **kw)
    monkeypatch.setattr(rv, "generate", counting)
    seen = clicking_stop(monkeypatch, rv, "compare_penalties", at=1)
    at = page("repetition", tiny_run, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    at.button(key="rep_compare").click().run()
    assert not at.exception, at.exception
    assert seen["units"] == 1 and len(seen["stop_buttons"][0]) == 1
    assert stopped(at, "the penalty comparison") and not at.get("progress")
    # stopped at its first record, before a token
    assert generated == [] and not session_of(at.session_state).memos["rep_tables"]
    next(b for b in at.button if b.label == "Compute again").click().run()
    assert not at.exception, at.exception
    variants = len(at.multiselect(key="rep_variants").value)
    assert seen["units"] == 2 and len(generated) == variants * 3       # every setting, 3 tokens each
    (table,) = [d.value for d in at.dataframe if "breaks the loop" in d.value.columns]
    assert len(table) == 1 + variants
    assert not [w for w in at.warning if w.value.startswith("Stopped")] and not at.get("progress")
