"""What a class sees, in real Chromium at 1280×720 with projector mode on (?projector=1): Run is on the first
screen, the model's name is whole, a demo run opens its page, every page renders without an exception with
chart labels of at least 16 px, and Stop ends a long run and keeps it. With $LLM_INSPECTOR_SCREENSHOTS set, saves a
screenshot of each page there (the README's: LLM_INSPECTOR_SCREENSHOTS=docs/screenshots)."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.browser.test_browser import (
    go_to,
    page_titles,
    wait_idle,
)
from tests.helpers import open_generation_settings, own_contexts, screenshots_dir

ROOT = Path(__file__).resolve().parents[2]
W, H = 1280, 720
pytestmark = pytest.mark.browser


def slug(title: str) -> str:
    return re.sub(r"\W+", "_", title.lower()).strip("_")


def screenshot(page, shots: Path | None, name: str) -> None:
    """The whole page: the window made as tall as the main area's content for the shot, then put back (when
    screenshots are asked for: tests.helpers.screenshots_dir)."""
    if shots is None:
        return
    path = shots / name
    tall = page.evaluate("() => Math.max(...Array.from(document.querySelectorAll('[data-testid=\"stMain\"], "
                         "[data-testid=\"stMain\"] *')).slice(0, 400).map(e => e.scrollHeight))")
    page.set_viewport_size({"width": W, "height": int(min(max(tall + 40, H), 6000))})
    page.wait_for_timeout(900)
    page.screenshot(path=str(path))
    page.set_viewport_size({"width": W, "height": H})
    page.wait_for_timeout(300)


def tick_font_sizes(page) -> list[float]:
    return page.evaluate("() => Array.from(document.querySelectorAll('.main-svg .xtick text, .main-svg .ytick text'))"
                         ".map(t => parseFloat(getComputedStyle(t).fontSize))")


def assert_no_exception(page, where: str) -> None:
    errors = page.locator('[data-testid="stException"]')
    assert errors.count() == 0, f"{where}: {errors.first.inner_text()[:500]}"


def first_contact(page, shots: Path | None) -> None:
    """The first screen: Run inside the window, the model named in full, the demos offered."""
    run = page.get_by_role("button", name="Run", exact=True)
    box = run.bounding_box()
    assert box is not None and 0 <= box["y"] and box["y"] + box["height"] <= H, box
    caption = page.locator('[data-testid="stSidebar"] [data-testid="stCaptionContainer"]', has_text="Model:").first
    assert "SmolLM2-135M-Instruct" in caption.inner_text()
    assert caption.evaluate("e => e.scrollWidth <= e.clientWidth + 1"), "the model's name is cut off"
    for label in ("Temperature and top-p", "A repetition loop", "A NaN fault"):
        assert page.get_by_role("button", name=label).first.is_visible()
    if shots is not None:
        page.screenshot(path=str(shots / "first_contact.png"))


def other_demo(page, label: str, lesson: str) -> None:
    """Start a demo from the sidebar's Demos expander; its page opens and says its lesson."""
    button = page.locator('[data-testid="stSidebar"]').get_by_role("button", name=label)
    if not button.is_visible():                       # the expander is closed
        page.get_by_text("Demos: one click, one lesson").click()
        page.wait_for_timeout(300)
    button.click()
    page.get_by_text(lesson).first.wait_for(timeout=300_000)
    wait_idle(page)
    assert_no_exception(page, label)


def stop_a_long_run(page) -> None:
    go_to(page, "Overview")
    chat = page.locator('[data-testid="stSidebar"] label:has-text("Chat format") input')
    if not chat.is_checked():                              # the loop demo turned it off
        page.locator('[data-testid="stSidebar"] label:has-text("Chat format")').click()
        wait_idle(page)
    page.get_by_role("textbox", name="Prompt", exact=True).fill("Tell me a very long story about a dragon.")
    open_generation_settings(page)
    box = page.get_by_label("Max new tokens", exact=True)
    box.fill("400")
    box.press("Enter")
    wait_idle(page)
    page.get_by_role("button", name="Run", exact=True).click()
    # any count from 3 on: the progress line is only on screen while the run goes, and a slow browser may first
    # see it at token 12 (the old pattern, tokens 3 to 9 only, then never matched)
    page.get_by_text(re.compile(r"token ([3-9]|[1-9]\d+) of at most 400")).first.wait_for(timeout=240_000)
    t0 = time.monotonic()
    page.locator('[data-testid="stSidebar"]').get_by_role("button", name="Stop", exact=True).click()
    page.get_by_text(re.compile(r"Stopped after \d+ tokens")).first.wait_for(timeout=120_000)
    assert time.monotonic() - t0 < 60
    wait_idle(page)
    metric = page.locator('[data-testid="stMetric"]', has_text="Stop reason").first.inner_text()
    assert "stopped" in metric
    assert not page.locator('[data-testid="stSidebar"]').get_by_role("button", name="Stop", exact=True).count()
    n = int(re.search(r"(\d+) generated", page.inner_text('[data-testid="stMain"]')).group(1))
    assert 3 <= n < 400


def test_projector_mode_1280x720_every_page_after_a_demo(server, browser):
    shots = screenshots_dir()
    with own_contexts(browser) as browser:
        page = browser.new_page(viewport={"width": W, "height": H})
        page.goto(server + "/?projector=1")
        page.wait_for_selector('[data-testid="stSidebar"] textarea', timeout=180_000)
        wait_idle(page)
        first_contact(page, shots)
        page.get_by_role("button", name="A repetition loop").first.click()
        page.wait_for_timeout(1500)
        wait_idle(page)
        assert_no_exception(page, "the loop demo")
        assert page.get_by_role("heading", name="Repetition").count(), "the demo did not open Repetition"
        assert "loop(s) in" in page.inner_text('[data-testid="stMain"]')
        for title in page_titles():
            go_to(page, title)
            assert_no_exception(page, title)
            body = page.inner_text('[data-testid="stMain"]')
            assert "press **Run**" not in body and "press Run" not in body, f"{title}: the run was lost"
            sizes = tick_font_sizes(page)
            assert not sizes or min(sizes) >= 16, (title, min(sizes))
            screenshot(page, shots, f"{slug(title)}.png")
        assert "Estimate: ≈" in page.inner_text('[data-testid="stSidebar"]')      # measured on this server
        for label, title, lesson in (("Temperature and top-p", "Sampling", "The chain runs in this order"),
                                     ("A NaN fault", "NaN doctor", "Stop reason non-finite logits")):
            other_demo(page, label, lesson)                  # its page, in the README, shows what it teaches
            screenshot(page, shots, f"{slug(title)}.png")
        stop_a_long_run(page)
        browser.close()
