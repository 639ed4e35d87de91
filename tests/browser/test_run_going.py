"""While a run goes (issue 33, item 9): Stop takes Run's place in the sidebar, so there is no Run that looks
clickable above Stop, and Run is back, enabled, once the run ends; the
footer counts the run's slot ("1 of 2 run slots busy"; it kept the count from before the click). Before: the click's
own script run left Run drawn enabled for the whole run; then, with Run emptied from its slot, the browser still showed
it, stale, until that script run (the whole run) ended, as Streamlit's frontend keeps a replaced widget of the previous
script run; Run now sits in a block of its own. On the tiny model with each step slowed (tests/browser/
test_run_traps_browser.py's server)."""
from __future__ import annotations

import re

import pytest

from tests.browser.test_browser import wait_idle
from tests.browser.test_run_traps_browser import open_app, slow_server  # noqa: F401  (a fixture)

pytestmark = pytest.mark.browser


def test_stop_takes_runs_place_and_the_footer_counts_the_run_while_it_goes(browser, slow_server):  # noqa: F811
    page = open_app(browser, slow_server)
    side = page.locator('[data-testid="stSidebar"]')
    footer = side.get_by_text(re.compile(r"^Server: \d+ of \d+ run slots busy"))
    assert footer.inner_text().startswith("Server: 0 of ")
    side.get_by_role("button", name="Run", exact=True).click()
    stop = side.get_by_role("button", name="Stop", exact=True)
    stop.wait_for(state="visible", timeout=30_000)
    runs = side.get_by_role("button", name="Run", exact=True)
    seen = []
    for _ in range(40):                                  # until the script has drawn its sidebar (a loaded machine)
        seen.append(runs.count())
        if footer.inner_text().startswith("Server: 1 of "):
            break
        page.wait_for_timeout(250)
    for _ in range(8):                                   # and for two more seconds of the run
        seen.append(runs.count())
        page.wait_for_timeout(250)
    assert stop.is_visible()                             # each step sleeps 2 s: the run is still going
    assert seen == [0] * len(seen), f"Run buttons in the sidebar while the run went: {seen}"
    assert footer.inner_text().startswith("Server: 1 of "), footer.inner_text()
    stop.click()
    wait_idle(page, 120)
    assert runs.count() == 1 and runs.is_enabled() and stop.count() == 0
    page.close()
