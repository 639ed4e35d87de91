"""The first visit after a server starts (issue 33, item 9): the first script run imports the engine and torch
(about 4 s), and the page was blank white until then. Now the first thing a visitor sees says the app is starting;
then the app replaces it."""
from __future__ import annotations

import os
import time

import pytest

from tests.browser.test_browser import wait_idle
from tests.helpers import streamlit_server

pytestmark = pytest.mark.browser
STARTING = "Starting LLM Inspector"


def test_a_fresh_servers_first_page_says_it_is_starting_then_shows_the_app(browser, tmp_path, tiny_model_dir):
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir), LLM_INSPECTOR_MODEL_ROOTS="",
               LLM_INSPECTOR_HUB_CACHE="off", OMP_NUM_THREADS="1")
    with streamlit_server(env, tmp_path / "streamlit.log", "--server.fileWatcherType", "none") as (url, _):
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url)
        first, t0 = "", time.monotonic()
        while time.monotonic() - t0 < 120 and not first:
            first = page.inner_text("body").replace("Skip to main content", "").strip()    # Streamlit's own link
            page.wait_for_timeout(50)
        assert STARTING in first, first[:500]                    # the first words on the page
        page.wait_for_selector('[data-testid="stSidebar"] textarea', timeout=180_000)
        wait_idle(page)
        assert page.get_by_text(STARTING).count() == 0          # gone once the app is drawn
        page.close()
