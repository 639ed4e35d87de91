"""AppTest: a demo's page says the demo's lesson at its top (inspector.ui.demos.lesson) on the Repetition and NaN
doctor pages too, while the session's run is the demo's run, and says nothing for any other run."""
from __future__ import annotations

import pytest

from engine import RunSettings
from inspector.session.run import inspect_run
from inspector.ui.demos import DEMOS
from inspector.ui.state import session_of

pytestmark = pytest.mark.app


@pytest.mark.parametrize("demo", ["loop", "nan"])
def test_the_demos_page_says_its_lesson_for_the_demos_run_only(page, tiny_model, tiny_model_dir, demo):
    d = DEMOS[demo]
    run = inspect_run(tiny_model, RunSettings(prompt=d.prompt, chat=False, max_new_tokens=2))
    at = page(d.page, run, tiny_model, str(tiny_model_dir))
    session_of(at.session_state).lesson = (demo, run.created)
    at.run()
    assert not at.exception, at.exception
    said = [i.value for i in at.info if i.value.startswith(f"**Demo: {d.label}.**")]
    assert said == [f"**Demo: {d.label}.** " + (d.lesson or d.blurb)]
    session_of(at.session_state).lesson = (demo, "another run")
    at.run()
    assert not [i for i in at.info if i.value.startswith("**Demo:")]
