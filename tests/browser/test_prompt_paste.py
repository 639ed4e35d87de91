"""A paste past the prompt's length limit, in real Chromium (issue 33, item 4). Streamlit's text area drops a
change longer than its max_chars without a word, so a 50,000-character paste once left the box as it was
("30/20000") and Run then answered the previous prompt. Now the box takes the paste, the sidebar says at once how
long it is and what the limit is, and Run starts nothing until it is shortened."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.browser.test_browser import wait_idle
from tests.helpers import streamlit_server

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.browser
PASTE = "The cat sat on the mat. " * 2_084 + "Why?!!!"          # 50,023 characters
SAID = "The prompt is 50,023 characters long; this server accepts at most 20,000"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    log = tmp_path_factory.mktemp("paste") / "streamlit.log"
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir), LLM_INSPECTOR_MODEL_ROOTS="",
               LLM_INSPECTOR_HUB_CACHE="off", OMP_NUM_THREADS="1")
    with streamlit_server(env, log, "--server.fileWatcherType", "none") as (url, _):
        yield url


def test_a_paste_past_the_limit_is_told_with_the_limit_and_run_runs_nothing(browser, server):
    assert len(PASTE) == 50_023
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(server)
    box = page.locator('[data-testid="stSidebar"] textarea')
    box.wait_for(timeout=180_000)
    wait_idle(page)
    box.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(PASTE)                       # what a paste does: one input event with the whole text
    assert len(box.input_value()) == len(PASTE)            # the box holds the paste, not the old prompt
    side = page.locator('[data-testid="stSidebar"]')
    side.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text(SAID).wait_for(timeout=30_000)
    wait_idle(page)
    # nothing ran: not the paste, and above all not the previous prompt
    page.wait_for_timeout(3_000)                           # a run of the tiny model would be over by now
    wait_idle(page)
    assert page.get_by_text("Stop reason").count() == 0 and page.get_by_text("prompt tokens ·").count() == 0
    assert side.get_by_role("button", name="Stop", exact=True).count() == 0
    page.close()
