"""One press of Run checks its settings against the server's limits once and tokenises its prompt once: the sidebar's
check hands its prompt ids to the estimate and to the run (inspector.session.run.Checked), and the engine generates
from those ids; the sidebar checks its widgets once per script run (the click's, and the redraw after the run).
Measured by this test on the code before: two checks against the limits, four of the widgets and six
tokenisations of the prompt (counting the estimate drawn after the run)."""
from __future__ import annotations

import sys

import pytest

from engine.generate import prompt_ids
from engine.tokenizer import Tokenizer
from inspector.session import run as run_mod
from inspector.ui import sidebar
from inspector.ui.state import session_of
from tests.app.test_app_pages_a import fresh_app

PROMPT = "Count the lighthouses of Brittany, please"


@pytest.fixture
def counts(monkeypatch):
    """Tokenisations of PROMPT (Tokenizer.encode / encode_chat, a call inside another counted once), calls of
    check_settings (the server's limits), wherever a module imported it, and of the sidebar's check of its widgets
    (generation_problems)."""
    n = {"tokenised": 0, "checked": 0, "widgets_checked": 0}
    depth = [0]

    def counted(orig, holds_prompt):
        def wrapper(self, first, *a, **kw):
            if depth[0] == 0 and holds_prompt(first):
                n["tokenised"] += 1
            depth[0] += 1
            try:
                return orig(self, first, *a, **kw)
            finally:
                depth[0] -= 1
        return wrapper

    monkeypatch.setattr(Tokenizer, "encode", counted(Tokenizer.encode, lambda text: PROMPT in text))
    monkeypatch.setattr(Tokenizer, "encode_chat", counted(Tokenizer.encode_chat, lambda msgs: PROMPT in repr(msgs)))
    original = run_mod.check_settings

    def check_settings(*a, **kw):
        n["checked"] += 1
        return original(*a, **kw)
    for mod in list(sys.modules.values()):
        if getattr(mod, "check_settings", None) is original:
            monkeypatch.setattr(mod, "check_settings", check_settings)
    problems = sidebar.generation_problems

    def generation_problems(*a, **kw):
        n["widgets_checked"] += 1
        return problems(*a, **kw)
    monkeypatch.setattr(sidebar, "generation_problems", generation_problems)
    return n


@pytest.mark.parametrize("chat", [True, False])
def test_one_run_checks_its_settings_once_and_tokenises_its_prompt_once(monkeypatch, tiny_model_dir, app_file,
                                                                        tiny_model, counts, chat):
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    at = fresh_app(monkeypatch, app_file)
    at.run()
    assert not at.exception
    at.sidebar.text_area(key="sb_prompt").set_value(PROMPT)
    at.sidebar.toggle(key="sb_chat").set_value(chat)
    at.sidebar.number_input(key="sb_max_new").set_value(3)
    counts.update(tokenised=0, checked=0, widgets_checked=0)
    at.sidebar.button(key="sb_run").click().run()
    assert not at.exception, at.exception
    run = session_of(at.session_state).run
    assert run is not None and run.settings.prompt == PROMPT and len(run.result.token_ids) >= 1
    assert counts == {"tokenised": 1, "checked": 1, "widgets_checked": 2}, counts   # widgets: once per script run
    # the ids the one tokenisation made are what the model saw: the engine's own tokenisation of the prompt
    assert run.result.prompt_ids == prompt_ids(tiny_model, PROMPT, chat=chat)
