"""Input attribution's two charts drawn by plotly.js in real Chromium (issue 33, item 7): every rotated token label
of the bar chart lies inside the figure (they were clipped to "ef", "'d"), and the deletion chart's x-axis title
does not overlap its legend (it was printed over it). Each figure is drawn as the app draws it (styled, and without
plotly.py's template, which Streamlit's chart theme replaces: drawn with it, the labels fitted even before the fix)."""
from __future__ import annotations

import pytest

from engine.tools.attribution import InputAttribution
from inspector.views import explain as xv
from inspector.views.theme import styled

pytestmark = pytest.mark.browser
# as inspector.views.tokens.token_labels makes them: position, then the token cut to 12 characters
TOKENS = ["<|im_start|>", "user", "⏎", "What", "·is", "·the", "·capital", "·of", "·France", "?", "<|im_end|>", "⏎",
          "<|im_start|>", "assistant", "⏎", "The", "·capital", "·of", "·France", "·is", "·Paris", "·and", "·it", "'d"]
LABELS = [f"{p} {t}" for p, t in enumerate(TOKENS)]
N = len(LABELS)


def attribution() -> InputAttribution:
    score = [((i * 37) % 11 - 5) / 5 for i in range(N)]
    curve = [-0.1 * k for k in range(N + 1)]
    return InputAttribution(ids=list(range(N)), target=1, target_text=" Paris", neutral=0, logp=-0.1,
                            scores={"occlusion": score, "grad_x_input": score[::-1]},
                            deletion={"occlusion": curve, "grad_x_input": curve[::-1], "random": curve},
                            areas={"occlusion": 0.5, "grad_x_input": 0.6, "random": 0.7})


def boxes(browser, fig, selector: str):
    import plotly.offline
    page = browser.new_page(viewport={"width": 900, "height": 1000})
    page.set_content("<html><body style='margin:0'><div id='f' style='width:760px'></div></body></html>")
    page.add_script_tag(content=plotly.offline.get_plotlyjs())
    spec = styled(fig).to_plotly_json()       # as the app draws it: its tick sizes, and Streamlit's chart theme in
    spec["layout"].pop("template", None)      # place of plotly.py's template (which turns automargin on for every axis)
    page.evaluate("(spec) => Plotly.newPlot('f', spec.data, spec.layout)", spec)
    page.wait_for_selector("#f .main-svg")
    out = page.evaluate("""(sel) => {
        const svg = document.querySelector('#f .main-svg').getBoundingClientRect();
        const r = (e) => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
        return {svg: [svg.left, svg.top, svg.right, svg.bottom],
                items: Array.from(document.querySelectorAll(sel)).map(r),
                texts: Array.from(document.querySelectorAll(sel)).map(e => e.textContent)};
    }""", selector)
    page.close()
    return out


def test_every_rotated_token_label_is_inside_the_bar_chart(browser):
    fig = xv.attribution_figure(attribution(), LABELS)
    got = boxes(browser, fig, "#f .xtick text")
    assert got["texts"] == LABELS
    left, top, right, bottom = got["svg"]
    for (x0, y0, x1, y1), text in zip(got["items"], got["texts"]):
        assert x0 >= left - 0.5 and y0 >= top - 0.5 and x1 <= right + 0.5 and y1 <= bottom + 0.5, \
            (text, (x0, y0, x1, y1), got["svg"])


def test_the_deletion_charts_axis_title_is_clear_of_its_legend(browser):
    fig = xv.deletion_figure(attribution())
    title = boxes(browser, fig, "#f .xtitle")["items"][0]
    legend = boxes(browser, fig, "#f .legend")["items"][0]
    apart = title[3] <= legend[1] or legend[3] <= title[1] or title[2] <= legend[0] or legend[2] <= title[0]
    assert apart, (title, legend)
