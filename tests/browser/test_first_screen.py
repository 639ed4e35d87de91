"""Issue 21, items 6 (first half) and 10: a fresh server's first script run lists no file of pages/ in the
sidebar, nobody is offered Streamlit's Deploy button, and the Overview's metrics are whole at 1440 and 1280 px.

The first script run of a fresh server process runs in Streamlit's v1 multipage mode (pages/ beside app.py:
streamlit/runtime/scriptrunner/script_runner.py, _mpa_v1), which sends a Navigation message listing every file
of pages/ ("common", "widgets", ...) before app.py's own st.navigation replaces it; only that first run of the
process does, so each check of it starts its own server and is its first session. Both ways of starting are
checked: `streamlit run app.py` in the repository (.streamlit/config.toml) and scripts/serve.sh."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.browser.test_browser import wait_idle
from tests.browser.test_forged_prompt import ForgedSession
from tests.helpers import free_port, own_contexts, server_process, streamlit_server

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.browser


def tiny_env(tiny_model_dir) -> dict:
    return dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir), LLM_INSPECTOR_MODEL_ROOTS="",
                LLM_INSPECTOR_HUB_CACHE="off", OMP_NUM_THREADS="1")


def first_run_messages(url: str) -> list:
    """Every ForwardMsg of the first script run of a server no session has used yet."""
    forged = ForgedSession(url)
    try:
        forged.rerun()
        msgs = list(forged.messages(time.monotonic() + 120))
    finally:
        forged.close()
    assert msgs and msgs[-1].WhichOneof("type") == "script_finished", [m.WhichOneof("type") for m in msgs][-20:]
    return msgs


def assert_no_file_list_and_no_deploy(msgs: list) -> None:
    from streamlit.proto.Navigation_pb2 import Navigation
    from streamlit.proto.NewSession_pb2 import Config
    session = next(m.new_session for m in msgs if m.WhichOneof("type") == "new_session")
    assert session.config.toolbar_mode in (Config.ToolbarMode.MINIMAL, Config.ToolbarMode.VIEWER), \
        Config.ToolbarMode.Name(session.config.toolbar_mode)           # AUTO shows Deploy on localhost
    assert session.config.hide_sidebar_nav
    navs = [m.navigation for m in msgs if m.WhichOneof("type") == "navigation"]
    assert navs, "no Navigation message in the first run"
    shown = [[p.page_name for p in n.app_pages] for n in navs if n.position != Navigation.Position.HIDDEN]
    assert not shown, f"a page list was drawn in the sidebar: {shown}"


def test_a_fresh_servers_first_run_lists_no_file_and_offers_no_deploy(tmp_path, tiny_model_dir):
    with streamlit_server(tiny_env(tiny_model_dir), tmp_path / "streamlit.log",
                          "--server.fileWatcherType", "none") as (url, _):
        assert_no_file_list_and_no_deploy(first_run_messages(url))


def test_serve_sh_from_another_folder_lists_no_file_and_offers_no_deploy(tmp_path, tiny_model_dir):
    port = free_port()
    env = dict(tiny_env(tiny_model_dir), LLM_INSPECTOR_PORT=str(port), PYTHON=os.environ.get("PYTHON", "python3"))
    cmd = ["bash", str(ROOT / "scripts" / "serve.sh"), "--server.fileWatcherType", "none"]
    with server_process(cmd, tmp_path, env, tmp_path / "serve.log", port) as (url, _):
        assert_no_file_list_and_no_deploy(first_run_messages(url))


CUT = """() => Array.from(document.querySelectorAll('[data-testid="stMain"] [data-testid="stMetric"] *'))
  .filter(e => e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflow !== 'visible')
  .map(e => e.textContent)"""


def test_overview_metrics_are_whole_and_there_is_no_deploy_button(tmp_path, tiny_model_dir, browser):
    with streamlit_server(tiny_env(tiny_model_dir), tmp_path / "streamlit.log",
                          "--server.fileWatcherType", "none") as (url, _), own_contexts(browser) as browser:
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.goto(url)
            page.wait_for_selector('[data-testid="stSidebar"] textarea', timeout=180_000)
            wait_idle(page)
            assert page.locator('[data-testid="stAppDeployButton"]').count() == 0
            assert page.locator('[data-testid="stSidebarNav"]').count() == 0
            box = page.locator('[data-testid="stSidebar"] textarea').first
            box.fill("one two three")
            box.press("Control+Enter")
            wait_idle(page)
            page.get_by_role("button", name="Run", exact=True).click()
            page.locator('[data-testid="stMetric"]', has_text="Stop reason").first.wait_for(timeout=180_000)
            wait_idle(page)
            stop = page.locator('[data-testid="stMetric"]', has_text="Stop reason").first.inner_text()
            assert "max_new_tokens" in stop or "eos" in stop, stop
            for width, height in ((1440, 1000), (1280, 720)):
                page.set_viewport_size({"width": width, "height": height})
                page.wait_for_timeout(800)
                assert page.locator('[data-testid="stMetric"]').count() >= 6
                assert page.evaluate(CUT) == [], f"metrics cut off at {width} px: {page.evaluate(CUT)}"
            page.locator('[data-testid="stSidebar"]').get_by_text("Projector mode").click()   # bigger type
            page.wait_for_timeout(800)
            wait_idle(page)
            assert page.locator('[data-testid="stMetric"]').count() >= 6
            assert page.evaluate(CUT) == [], f"metrics cut off in projector mode: {page.evaluate(CUT)}"
            assert page.locator('[data-testid="stAppDeployButton"]').count() == 0
        finally:
            browser.close()
