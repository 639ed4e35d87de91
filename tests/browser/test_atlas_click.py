"""The head atlas's scatter clicked in a real Chromium (the browser's own plotly selection event, which the AppTest
of tests/app/test_app_head_atlas.py writes by hand): on the tiny model, the atlas computed on its button, a click on
the point of head (l, h) opens layer l, head h in the Attention page's Layer and Head controls and its map."""
from __future__ import annotations

import os

import pytest

from tests.browser.test_browser import go_to, wait_idle
from tests.helpers import TINY, own_contexts, streamlit_server

pytestmark = pytest.mark.browser


@pytest.fixture
def tiny_server(tiny_model_dir, tmp_path, browser):
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir), LLM_INSPECTOR_CACHE=str(tmp_path / "cache"))
    with streamlit_server(env, tmp_path / "streamlit.log") as (url, _proc):
        yield url


def test_a_click_on_a_scatter_point_opens_its_head(tiny_server, browser):
    L, H = TINY["num_hidden_layers"], TINY["num_attention_heads"]
    i = L * H - 2
    layer, head = divmod(i, H)
    with own_contexts(browser) as b:
        page = b.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(tiny_server)
        page.wait_for_selector('[data-testid="stSidebar"] textarea', timeout=180_000)
        wait_idle(page)
        box = page.locator('[data-testid="stSidebar"] textarea').first
        box.fill("one two three four five six")
        box.press("Control+Enter")
        wait_idle(page)
        page.get_by_role("button", name="Run", exact=True).click()
        page.wait_for_timeout(1000)
        wait_idle(page)
        go_to(page, "Attention")
        page.get_by_role("button", name="Compute the head atlas").click()
        page.wait_for_timeout(1000)
        wait_idle(page)
        chart = page.locator('[data-testid="stPlotlyChart"]').filter(has_text="Every head")
        point = chart.locator(".scatterlayer .trace path.point").nth(i)
        point.scroll_into_view_if_needed()
        point.click(force=True)
        page.wait_for_timeout(1000)
        wait_idle(page)
        main = page.inner_text('[data-testid="stMain"]')
        assert page.locator('[data-testid="stException"]').count() == 0
        assert f"Layer {layer}, head {head}: windows by" in main, main[-2000:]
        assert "click was ignored" not in main
        heatmap = page.locator('[data-testid="stPlotlyChart"]').filter(has_text=f"Layer {layer}, head {head}")
        assert heatmap.count() == 1                           # the page's own map, now of that head
