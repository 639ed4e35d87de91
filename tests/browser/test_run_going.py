"""While a run goes (issue 33, item 9): the footer counts the run's slot ("1 of 2 run slots busy"; it kept the
count from before the click). (Greying Run out above Stop is not done: redrawing it disabled left the stale enabled
button on the page too, two Run buttons.) On the tiny model with each step slowed (tests/browser/
test_run_traps_browser.py's server)."""
from __future__ import annotations

import re

import pytest

from tests.browser.test_browser import wait_idle
from tests.browser.test_run_traps_browser import open_app, slow_server  # noqa: F401  (a fixture)

pytestmark = pytest.mark.browser


def test_the_footer_counts_the_run_while_it_goes(browser, slow_server):  # noqa: F811
    page = open_app(browser, slow_server)
    side = page.locator('[data-testid="stSidebar"]')
    footer = side.get_by_text(re.compile(r"^Server: \d+ of \d+ run slots busy"))
    assert footer.inner_text().startswith("Server: 0 of ")
    side.get_by_role("button", name="Run", exact=True).click()
    stop = side.get_by_role("button", name="Stop", exact=True)
    stop.wait_for(state="visible", timeout=30_000)
    for _ in range(40):                                  # until the script has drawn its sidebar (a loaded machine)
        if footer.inner_text().startswith("Server: 1 of "):
            break
        page.wait_for_timeout(250)
    assert stop.is_visible()                             # each step sleeps 2 s: the run is still going
    assert footer.inner_text().startswith("Server: 1 of "), footer.inner_text()
    stop.click()
    wait_idle(page, 120)
    assert side.get_by_role("button", name="Run", exact=True).is_enabled()
    page.close()
