"""The real app, served on localhost, driven by headless Chromium: run the bundled model once, then visit
every page through the sidebar navigation; fail on any Streamlit exception box; with $LLM_INSPECTOR_SCREENSHOTS set,
save a screenshot of each page there."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.helpers import RUNNING, own_contexts, screenshots_dir

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run", "--disable-quic", "--disable-sync"]
PROMPT = "What is the capital of France?"

pytestmark = pytest.mark.browser


def page_titles() -> list[str]:
    return re.findall(r'st\.Page\("pages/\w+\.py", title="([^"]+)"', (ROOT / "app.py").read_text())


# `server`, the app on the bundled model, is tests/browser/conftest.py's: one process for this module,
# test_projector.py and test_projector_sampling.py.


def wait_idle(page, timeout_s: float = 240) -> None:
    """Until the script has finished running (the 'Running...' status widget is gone for a moment)."""
    deadline = time.time() + timeout_s
    quiet = 0
    while time.time() < deadline:
        running = page.locator(RUNNING).count() > 0
        quiet = 0 if running else quiet + 1
        if quiet >= 3:
            return
        page.wait_for_timeout(400)
    raise AssertionError("the app was still running after %.0f s" % timeout_s)


def go_to(page, title: str) -> None:
    """Open a page through the sidebar's list of pages."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    page.locator('[data-testid="stSidebar"]').get_by_role("link", name=title, exact=True).first.click()
    try:            # the page's script has started (at most 800 ms: a script that ended unseen in between is idle)
        page.locator(RUNNING).first.wait_for(state="attached", timeout=800)
    except PlaywrightTimeout:
        pass
    wait_idle(page)


def test_every_page_in_chromium(server, browser):
    shots = screenshots_dir()
    titles = page_titles()
    assert len(titles) >= 7
    with own_contexts(browser) as browser:
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(server)
        page.wait_for_selector('[data-testid="stSidebar"] textarea', timeout=180_000)
        wait_idle(page)
        box = page.locator('[data-testid="stSidebar"] textarea').first
        box.fill(PROMPT)
        box.press("Control+Enter")
        wait_idle(page)
        page.get_by_role("button", name="Run", exact=True).click()
        page.wait_for_timeout(1000)
        wait_idle(page)
        assert "Paris" in page.inner_text("body"), "the bundled model's answer did not appear"
        for title in titles:
            go_to(page, title)
            slug = re.sub(r"\W+", "_", title.lower()).strip("_")
            if shots is not None:
                page.screenshot(path=str(shots / f"{slug}.png"), full_page=True)
            errors = page.locator('[data-testid="stException"]')
            assert errors.count() == 0, f"{title}: {errors.first.inner_text()[:500]}"
            body = page.inner_text('[data-testid="stMain"]')
            assert "press **Run**" not in body and "press Run" not in body, f"{title}: the run was lost"
        browser.close()
