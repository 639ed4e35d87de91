"""What the browser tier shares: one headless Chromium, and the servers no test needs fresh (a first visitor, a
restart, a count of the process's own generations, or other settings keep their own server). Each is started
by the first test that asks for it and stopped when the run leaves tests/browser/, so none of them idles
through the tiers that follow."""
from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.helpers import streamlit_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-quic", "--disable-sync"]          # as tests/conftest.py's
HERE = Path(__file__).resolve().parent


class Shared:
    """Context managers entered once and kept until close(); a start that fails is tried again by the next test."""

    def __init__(self) -> None:
        self._stack: ExitStack | None = None
        self._values: dict[str, object] = {}

    def get(self, key: str, start):
        if key not in self._values:
            if self._stack is None:
                self._stack = ExitStack()
            self._values[key] = self._stack.enter_context(start())
        return self._values[key]

    def close(self) -> None:
        stack, self._stack, self._values = self._stack, None, {}
        if stack is not None:
            stack.close()


SHARED = Shared()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last browser test of a run (the next test is elsewhere, or there is none): stop what is shared."""
    if nextitem is None or Path(str(nextitem.fspath)).resolve().parent != HERE:
        SHARED.close()


def pytest_sessionfinish(session, exitstatus):
    SHARED.close()


def _need_chromium():
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (scripts/setup.sh --test installs Debian's chromium)")
    return pytest.importorskip("playwright.sync_api")


@pytest.fixture
def browser():
    """Debian's headless Chromium through Playwright, one process for the browser tier (tests/conftest.py's
    `browser` starts one per module). A test opens its own contexts (its own cookies and sessions) and closes
    them; tests.helpers.own_contexts closes what a test opened even when it fails."""
    sync_api = _need_chromium()

    def start():
        from contextlib import contextmanager

        @contextmanager
        def launched():
            with sync_api.sync_playwright() as pw:
                b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
                try:
                    yield b
                finally:
                    b.close()
        return launched()
    b = SHARED.get("chromium", start)
    yield b
    for ctx in list(b.contexts):          # what a test left open does not reach the next one
        try:
            ctx.close()
        except Exception:
            pass


@pytest.fixture
def server(tmp_path_factory):
    """The app as `streamlit run app.py` serves it on the bundled model (no $LLM_INSPECTOR_MODEL): one process
    for tests/browser/test_browser.py, test_projector.py and test_projector_sampling.py, each in its own browser
    session. Modules that define their own `server` fixture (test_load_server, test_rooms) use theirs."""
    _need_chromium()
    env = {k: v for k, v in os.environ.items() if k != "LLM_INSPECTOR_MODEL"}

    def start():
        return _url_only(streamlit_server(env, tmp_path_factory.mktemp("server") / "streamlit.log"))
    return SHARED.get("bundled-server", start)


def _url_only(served):
    from contextlib import contextmanager

    @contextmanager
    def cm():
        with served as (url, _proc):
            yield url
    return cm()
