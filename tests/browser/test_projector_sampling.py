"""The Sampling page on a projector, in real Chromium at 1280×720 with ?projector=1, after the *Temperature and
top-p* demo (issue 21, item 7): the demo's lesson is on the first screen, every table's text is at least the
charts' type (PROJECTOR_FONT px: an HTML table, never the 13-px canvas grid), and the comparison's token labels
are horizontal, at least the projector's tick size, and none overlaps another."""
from __future__ import annotations

import pytest

from inspector.views.theme import PROJECTOR_FONT, PROJECTOR_TICKS
from tests.browser.test_browser import wait_idle
from tests.helpers import own_contexts

W, H = 1280, 720
pytestmark = pytest.mark.browser

# Font sizes of every piece of text in the main area's HTML tables, and the number of canvas grids there.
TABLES_JS = """() => {
  const main = document.querySelector('[data-testid="stMain"]');
  const tables = Array.from(main.querySelectorAll('[data-testid="stTable"]'));
  const sizes = [];
  for (const t of tables) {
    const walker = document.createTreeWalker(t, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode())
      if (n.textContent.trim()) sizes.push(parseFloat(getComputedStyle(n.parentElement).fontSize));
  }
  // a grid in a closed expander (the whole of a long table, on request) is not shown
  const shown = g => { const d = g.closest('details'); return !d || d.open; };
  const grids = Array.from(main.querySelectorAll('[data-testid="stDataFrame"]')).filter(shown);
  return {tables: tables.length, sizes, grids: grids.length};
}"""

# The comparison figure (the plot whose panel titles say "kept"): each x tick label's box, size and rotation.
TICKS_JS = """() => {
  const plot = Array.from(document.querySelectorAll('.js-plotly-plot')).find(p =>
    Array.from(p.querySelectorAll('.annotation-text')).some(a => /^A: kept/.test(a.textContent)));
  if (!plot) return null;
  return Array.from(plot.querySelectorAll('.xaxislayer-above text')).map(t => {   // .xtick, .x2tick, ...
    const r = t.getBoundingClientRect();
    return {text: t.textContent, x0: r.left, x1: r.right, y0: r.top, y1: r.bottom,
            size: parseFloat(getComputedStyle(t).fontSize), transform: t.getAttribute('transform') || ''};
  });
}"""


def overlapping(boxes: list[dict]) -> list[tuple[str, str]]:
    return [(a["text"], b["text"]) for i, a in enumerate(boxes) for b in boxes[i + 1:]
            if a["x0"] < b["x1"] and b["x0"] < a["x1"] and a["y0"] < b["y1"] and b["y0"] < a["y1"]]


def test_sampling_after_the_demo_on_a_projector_shows_its_lesson_big_tables_and_readable_labels(server, browser):
    with own_contexts(browser) as browser:
        page = browser.new_page(viewport={"width": W, "height": H})
        page.goto(server + "/?projector=1")
        page.wait_for_selector('[data-testid="stSidebar"] textarea', timeout=180_000)
        wait_idle(page)
        page.get_by_role("button", name="Temperature and top-p").first.click()
        page.get_by_text("The chain runs in this order").first.wait_for(timeout=300_000)
        wait_idle(page)

        # the lesson, whole, on the first screen (the page as it opened, not scrolled)
        assert page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollTop") == 0
        lesson = page.locator('[data-testid="stMain"] [data-testid="stAlert"]', has_text="Demo: Temperature")
        assert lesson.count() == 1, "no lesson on the demo's page"
        box = lesson.bounding_box()
        assert box is not None and 0 <= box["y"] and box["y"] + box["height"] <= H, box
        said = lesson.inner_text()
        assert "temperature reshapes the distribution before top-p cuts it" in said
        assert "B can keep more than C although its top-p is smaller" in said

        page.locator(".js-plotly-plot .annotation-text", has_text="C: kept").first.wait_for(timeout=60_000)
        page.wait_for_timeout(1000)                   # the tables below the figure

        # the comparison chart starts on the first screen, under the lesson (issue 33, item 6: it was 1,934 px down,
        # below the step, the settings and three columns of sliders)
        assert page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollTop") == 0
        chart = page.locator('[data-testid="stMain"] .js-plotly-plot').first.bounding_box()
        print(f"the comparison chart's top: {chart['y']:.0f} px; the lesson ends at {box['y'] + box['height']:.0f} px")
        assert chart is not None and box["y"] + box["height"] <= chart["y"] <= H - 160, chart      # 160 px at least

        # every table: HTML, its text at least the charts' type; no 13-px canvas grid on the page
        found = page.evaluate(TABLES_JS)
        assert found["tables"] == 3 and found["grids"] == 0, found
        assert found["sizes"] and min(found["sizes"]) >= PROJECTOR_FONT, sorted(set(found["sizes"]))

        # the comparison: 3 panels of 10 labels, horizontal, projector-sized, none overlapping another
        ticks = page.evaluate(TICKS_JS)
        assert ticks is not None and len(ticks) == 30, ticks
        assert min(t["size"] for t in ticks) >= PROJECTOR_TICKS
        assert not [t for t in ticks if "rotate" in t["transform"]], ticks[0]["transform"]
        assert overlapping(ticks) == []
        browser.close()
