"""A classroom network may have no internet, and where it has, no student's browser should contact a third
party: the app, loaded in real Chromium and walked through every page after a run, asks nothing of any host
but the server's own (127.0.0.1). Every request the page makes is recorded (and any to another host is
refused, so the test never depends on the internet); the favicon, which Chromium may fetch outside the page's
own requests, must be the server's or inline (Streamlit turns a `:material/…:` page icon into a link to a
public font server, an emoji into an inline SVG)."""
from __future__ import annotations

import os
from urllib.parse import urlsplit

import pytest

from tests.browser.test_browser import go_to, page_titles, wait_idle
from tests.helpers import streamlit_server

pytestmark = pytest.mark.browser
LOCAL = "127.0.0.1"


def outside(url: str) -> bool:
    """A URL the browser would fetch from a host other than this server (data: and blob: are inline)."""
    parts = urlsplit(url)
    return parts.scheme not in ("data", "blob", "about", "") and parts.hostname != LOCAL


def test_the_app_loads_nothing_from_outside_the_server(browser, tiny_model_dir, tmp_path):
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir))
    with streamlit_server(env, tmp_path / "streamlit.log") as (url, _):
        context = browser.new_context(viewport={"width": 1280, "height": 720})
        asked: list[str] = []

        def record(route) -> None:
            asked.append(route.request.url)
            if outside(route.request.url):
                route.abort()
            else:
                route.continue_()

        context.route("**/*", record)
        page = context.new_page()
        page.goto(url)
        page.wait_for_selector('[data-testid="stSidebar"] textarea', timeout=180_000)
        wait_idle(page)
        icons: dict[str, list[str]] = {}

        def favicons(where: str) -> None:
            icons[where] = page.eval_on_selector_all("link[rel~='icon']", "ls => ls.map(l => l.href)")

        favicons("first screen")
        page.get_by_role("button", name="Run", exact=True).click()
        page.wait_for_timeout(800)
        wait_idle(page)
        titles = page_titles()
        assert len(titles) >= 10
        for title in titles:
            go_to(page, title)
            favicons(title)
        context.close()

    assert len(asked) > 20, asked          # the recorder saw the app's own files (scripts, styles, fonts)
    assert any(urlsplit(u).path.endswith(".js") for u in asked), asked
    assert [u for u in asked if outside(u)] == []
    assert all(icons.values()), icons      # a favicon is set on every page…
    assert {w: hrefs for w, hrefs in icons.items() if any(outside(h) for h in hrefs)} == {}   # …from here
