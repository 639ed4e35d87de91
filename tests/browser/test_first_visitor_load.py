"""Issue 21, item 6 (second half): the first visitors after a start see the app, with the model load's progress.

The server's model load is held from the test side: a sitecustomize.py on PYTHONPATH (a temp folder) wraps
engine.load_model so that each load reports "held by the test, tick N" at N % (up to 50 %) every 0.2 s until
the test writes its gate file, and records each call. While it is held, nothing is loaded, so what the
visitors see then is what a slow load shows; the old app waited for the model before drawing the prompt box or the
page, so the Overview's introduction never appeared while the gate was closed."""
from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest

from tests.browser.test_browser import wait_idle
from tests.browser.test_projector import assert_no_exception
from tests.helpers import ROOT, own_contexts, streamlit_server, tiny_config

pytestmark = pytest.mark.browser
INTRO = "runs a small language model on this server"
PROGRESS = re.compile(r"Loading the model: held by the test, tick (\d+) \((\d+)%")

HOLD = textwrap.dedent('''
    """Test-only (tests/browser/test_first_visitor_load.py): every model load waits for the gate file."""
    import time
    from pathlib import Path

    import engine
    import engine.loader

    HERE = Path(__file__).parent
    real = engine.loader.load_model


    def held(source=None, *, progress=None, **kw):
        with open(HERE / "calls.txt", "a") as f:
            f.write(f"{source}\\n")
        tick = 0
        while not (HERE / "gate").exists():
            tick += 1
            if progress is not None:
                progress(min(50, tick) / 100, f"held by the test, tick {tick}")
            time.sleep(0.2)
        return real(source, progress=progress, **kw)


    engine.load_model = engine.loader.load_model = held
    print("sitecustomize: model loads wait for", HERE / "gate", flush=True)
''')


def sidebar_progress(page) -> tuple[int, int]:
    """(tick, percent) of the load's progress as the sidebar shows it."""
    text = page.locator('[data-testid="stSidebar"] [data-testid="stProgress"]').first.inner_text()
    m = PROGRESS.search(text)
    assert m, text
    return int(m[1]), int(m[2])


def pick_model(page, option: str) -> None:
    """Choose a model in the sidebar's "Model and device" (open); the list is opened again if a rerun closed it."""
    for _ in range(5):
        page.get_by_label("Model", exact=True).first.click()
        try:
            page.get_by_role("option", name=option, exact=True).click(timeout=5_000)
            return
        except Exception:          # playwright's TimeoutError: the list was not open
            page.keyboard.press("Escape")
    raise AssertionError(f"could not choose {option!r}")


def run_button(page):
    return page.locator('[data-testid="stSidebar"]').get_by_role("button", name="Run", exact=True)


def test_the_first_visitors_see_the_app_and_the_loads_progress(tmp_path, tiny_model_dir, browser):
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD)
    roots = tmp_path / "models"
    (roots / "broken-model").mkdir(parents=True)          # a config and no weights: a load that fails
    (roots / "broken-model" / "config.json").write_text(json.dumps(tiny_config()))
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir), LLM_INSPECTOR_MODEL_ROOTS=str(roots),
               LLM_INSPECTOR_HUB_CACHE="off", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(hold), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    with streamlit_server(env, tmp_path / "streamlit.log", "--server.fileWatcherType", "none") as (url, _), \
            own_contexts(browser) as browser:
        try:
            first = browser.new_context().new_page()
            first.set_viewport_size({"width": 1280, "height": 720})
            first.goto(url)
            # the page and the sidebar's prompt while the load is held (the old app drew neither until loaded)
            first.get_by_text(INTRO).first.wait_for(timeout=60_000)
            first.locator('[data-testid="stSidebar"] textarea').first.wait_for(timeout=60_000)
            first.locator('[data-testid="stSidebar"] [data-testid="stProgress"]').first.wait_for(timeout=60_000)
            # (drawn in the same script run as the intro, possibly a moment after it: wait for it, the load still held)
            first.get_by_role("button", name="A repetition loop").first.wait_for(state="visible", timeout=60_000)
            assert run_button(first).is_disabled()
            tick, percent = sidebar_progress(first)
            assert percent == min(50, tick)            # the wrapper's own fraction: tick N is N %, up to 50 %
            # the progress moves while the load runs (the wrapper's ticks, 0.2 s apart)
            first.wait_for_function(
                """t => { const e = document.querySelector('[data-testid="stSidebar"] [data-testid="stProgress"]');
                          const m = e && e.innerText.match(/tick (\\d+)/); return m && Number(m[1]) > t; }""",
                arg=tick, timeout=60_000)
            assert not (hold / "gate").exists()
            shots = Path(os.environ.get("LLM_INSPECTOR_SCREENSHOTS", tmp_path))
            first.screenshot(path=str(shots / "first_visitor_loading.png"))

            # a second visitor meanwhile: the same load's progress (one load), and a demo that waits for it
            second = browser.new_context().new_page()
            second.goto(url)
            second.get_by_text(INTRO).first.wait_for(timeout=60_000)
            second.locator('[data-testid="stSidebar"] [data-testid="stProgress"]').first.wait_for(timeout=60_000)
            second.get_by_role("button", name="A repetition loop").first.click()
            second.get_by_text("Your demo starts as soon as it is ready").first.wait_for(timeout=60_000)
            assert (hold / "calls.txt").read_text().splitlines() == [str(tiny_model_dir)]

            (hold / "gate").write_text("go")
            # the load ends: the progress goes, the model is named, Run works
            first.locator('[data-testid="stSidebar"]').get_by_text("Model: tiny-llama").first.wait_for(timeout=120_000)
            wait_idle(first)
            assert first.locator('[data-testid="stSidebar"] [data-testid="stProgress"]').count() == 0
            first.locator('[data-testid="stSidebar"] textarea').first.fill("one two three")
            first.locator('[data-testid="stSidebar"] textarea').first.press("Control+Enter")
            wait_idle(first)
            run_button(first).click()
            stop = first.locator('[data-testid="stMetric"]', has_text="Stop reason").first
            stop.wait_for(timeout=120_000)
            assert "max_new_tokens" in stop.inner_text() or "eos" in stop.inner_text()
            assert_no_exception(first, "the first visitor's run")
            # the second visitor's demo ran once the model was there, and opened its page
            second.get_by_role("heading", name="Repetition").first.wait_for(timeout=120_000)
            second.get_by_text("Demo: A repetition loop").first.wait_for(timeout=60_000)
            assert_no_exception(second, "the demo clicked while the model loaded")
            assert (hold / "calls.txt").read_text().splitlines() == [str(tiny_model_dir)]    # one load for both

            # a load that fails says why on screen, and the app keeps running
            first.get_by_text("Model and device").first.click()
            wait_idle(first)
            pick_model(first, "broken-model (server models)")
            said = first.locator('[data-testid="stSidebar"] [data-testid="stAlert"]',
                                 has_text="Could not load the model").first
            said.wait_for(timeout=120_000)
            assert "no model.safetensors" in said.inner_text() and str(roots) not in said.inner_text()
            wait_idle(first)
            assert run_button(first).is_disabled()
            assert_no_exception(first, "a failed load")
            pick_model(first, "tiny-llama (server default)")
            first.locator('[data-testid="stSidebar"]').get_by_text("Model: tiny-llama").first.wait_for(timeout=60_000)
            wait_idle(first)
            assert run_button(first).is_enabled()
        finally:
            browser.close()
