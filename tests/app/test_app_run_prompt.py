"""Issue 21, item 10: which prompt the Debugger and Compare run after a trace file is opened (the opened run's,
said on the page, with the sidebar's one choice away), and the Overview's "prompt as the model saw it", where
text typed in a prompt that spells a special token does not look like the real special token."""
from __future__ import annotations

import pytest

from engine import RunSettings
from engine.generate import prompt_ids
from engine.inspection.trace import from_bytes, to_bytes
from inspector.session.run import inspect_run
from inspector.ui.state import session_of
from tests.app.test_app_pages_a import page as page_path
from tests.app.test_run_traps import fresh_app
from tests.helpers import as_shown

pytestmark = pytest.mark.app
OPENED = "one two three four five"          # the file's prompt, chat format off
SIDEBAR = "Tell me about caches."


@pytest.fixture(scope="module")
def opened(tiny_model):
    """A run as the Trace files page opens it: written to a trace file and read back."""
    run = inspect_run(tiny_model, RunSettings(prompt=OPENED, chat=False, max_new_tokens=3, seed=5))
    return from_bytes(to_bytes(run))


def captions(at) -> str:
    return "\n".join(as_shown(c.value) for c in at.caption)


def with_opened_run(monkeypatch, app_file, tiny_model_dir, opened):
    at = fresh_app(monkeypatch, app_file, tiny_model_dir)
    at.sidebar.text_area(key="sb_prompt").set_value(SIDEBAR).run()
    session_of(at.session_state).run = opened
    return at


def test_the_debugger_runs_the_opened_runs_prompt_and_says_so(monkeypatch, app_file, tiny_model_dir, tiny_model,
                                                               opened):
    at = with_opened_run(monkeypatch, app_file, tiny_model_dir, opened)
    at.switch_page(page_path(app_file, "debugger")).run()
    assert not at.exception, at.exception
    assert "Step and Reset start a run of **the current run's** prompt: 'one two three four five'" in captions(at)
    at.button(key="dbg_step").click().run()
    assert not at.exception, at.exception
    run = session_of(at.session_state).run
    assert run.result.prompt_ids == tiny_model.tokenizer.encode(OPENED)       # chat off, as in the file
    assert run.settings.seed == 5
    # the sidebar's prompt, one choice away
    at.radio(key="dbg_source").set_value("the sidebar").run()
    assert "start a run of **the sidebar's** prompt: 'Tell me about caches.'" in captions(at)
    at.button(key="dbg_reset").click().run()
    at.button(key="dbg_step").click().run()
    assert not at.exception, at.exception
    assert session_of(at.session_state).run.result.prompt_ids == prompt_ids(tiny_model, SIDEBAR, chat=True)


def test_compare_runs_the_opened_runs_prompt_and_says_so(monkeypatch, app_file, tiny_model_dir, tiny_model, opened):
    at = with_opened_run(monkeypatch, app_file, tiny_model_dir, opened)
    at.switch_page(page_path(app_file, "compare")).run()
    assert not at.exception, at.exception
    assert "Prompt (from the current run, the one every other page shows; choose the sidebar to compare its prompt " \
           f"instead): {OPENED!r} · chat format off" in captions(at)
    assert at.number_input(key="cmp_seed").value == 5
    at.number_input(key="cmp_max_new").set_value(2)
    at.button(key="cmp_run").click().run()
    assert not at.exception, at.exception
    assert session_of(at.session_state).compared["a"].prompt_ids == tiny_model.tokenizer.encode(OPENED)
    at.radio(key="cmp_source").set_value("the sidebar").run()
    assert f"Prompt (from the sidebar): {SIDEBAR!r} · chat format on" in captions(at)
    at.button(key="cmp_run").click().run()
    assert session_of(at.session_state).compared["a"].prompt_ids == prompt_ids(tiny_model, SIDEBAR, chat=True)


@pytest.mark.parametrize("allow_special", [False, True])
def test_typed_special_token_text_is_not_shown_as_a_special_token(page, tiny_model, tiny_model_dir, allow_special):
    tok = tiny_model.tokenizer
    run = inspect_run(tiny_model, RunSettings(prompt="Say <|im_end|> now", chat=True, allow_special=allow_special,
                                              max_new_tokens=1))
    at = page("overview", run, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    shown = at.code[0].value
    real = run.result.prompt_ids.count(tok.special_token_id("<|im_end|>"))   # the template's, and the typed one
    assert real == (3 if allow_special else 2)                                # when it acts as a control token
    typed = shown.count("[typed text: <|im_end|>]")
    assert typed == (0 if allow_special else 1)
    assert shown.count("<|im_end|>") - typed == real
    assert any("[typed text: …] marks text" in c.value for c in at.caption) == (not allow_special)
