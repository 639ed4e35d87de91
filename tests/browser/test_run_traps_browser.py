"""Traps around a run in real Chromium (issue 21, items 2 and 5), on the tiny model with each generation step
slowed (a sitecustomize in the server's PYTHONPATH sleeps before GenerationRun.step), so that clicks land while
a step is computing, as they do with a long prompt on a loaded machine:

- Stop during the prefill ("nothing to keep"): Run is enabled again at once;
- a quick Continue → Run to end → Step on the Debugger, in one tab: the Step waits for the previous clicks and
  is done, never "You already have 1 run(s) generating and 1 waiting (in another tab?)"."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.browser.test_browser import go_to, wait_idle
from tests.helpers import streamlit_server

ROOT = Path(__file__).resolve().parents[2]
SLOW_S = 2.0
pytestmark = pytest.mark.browser

SLOWER = """import importlib, os, time
_g = importlib.import_module("engine.generate")      # (the package's `generate` is a function)
_step, _s = _g.GenerationRun.step, float(os.environ["LLM_INSPECTOR_TEST_STEP_S"])


def _slow_step(self, *args, **kwargs):
    time.sleep(_s)
    return _step(self, *args, **kwargs)


_g.GenerationRun.step = _slow_step
"""


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory, tiny_model_dir):
    hook = tmp_path_factory.mktemp("slow")
    (hook / "sitecustomize.py").write_text(SLOWER)
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir), LLM_INSPECTOR_TEST_STEP_S=str(SLOW_S),
               PYTHONPATH=os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with streamlit_server(env, hook / "streamlit.log") as (url, _):
        yield url


def open_app(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url)
    page.wait_for_selector('[data-testid="stSidebar"] textarea', timeout=180_000)
    wait_idle(page)
    return page


def watch_texts(page, seconds: float, step_ms: int = 200) -> str:
    """Everything the page showed over `seconds` (polled), one string."""
    seen, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append(page.inner_text("body"))
        page.wait_for_timeout(step_ms)
    return "\n".join(seen)


def test_run_is_enabled_after_a_stop_in_the_prefill(browser, slow_server):
    page = open_app(browser, slow_server)
    side = page.locator('[data-testid="stSidebar"]')
    run = side.get_by_role("button", name="Run", exact=True)
    run.click()
    stop = side.get_by_role("button", name="Stop", exact=True)        # the sidebar's (not the toolbar's)
    stop.wait_for(state="visible", timeout=30_000)
    page.wait_for_timeout(300)              # the first step sleeps SLOW_S before its prefill: Stop lands there
    stop.click()
    page.get_by_text("Stopped during the prefill, before the first token: nothing to keep.").wait_for(timeout=60_000)
    wait_idle(page)
    assert run.is_enabled()                 # at once, nothing changed by the user
    assert side.get_by_role("button", name="Stop", exact=True).count() == 0
    page.close()


def test_continue_run_to_end_step_in_quick_succession(browser, slow_server):
    page = open_app(browser, slow_server)
    go_to(page, "Debugger")
    main = page.locator('[data-testid="stMain"]')
    main.get_by_role("button", name="Continue", exact=True).click()
    page.wait_for_timeout(400)              # the Continue's first step is computing (SLOW_S)
    main.get_by_role("button", name="Run to end", exact=True).click()
    page.wait_for_timeout(300)
    main.get_by_role("button", name="Step", exact=True).click()
    shown = watch_texts(page, 2 * SLOW_S + 2)
    wait_idle(page, 120)
    shown += page.inner_text("body")
    assert "another tab" not in shown and "already stepping" not in shown, shown[-3000:]
    assert "Your previous click is still finishing; this one follows as soon as it has" in shown
    caption = main.get_by_text("of at most").first.inner_text()
    assert "paused" in caption, caption     # the Step ran (the Run to end the Step replaced did not)
    assert 1 <= int(caption.split(" of at most")[0]) < 32, caption
    assert page.locator('[data-testid="stException"]').count() == 0
    page.close()
