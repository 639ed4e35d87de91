"""While a run goes (issue 33, item 9): Stop takes Run's place in the sidebar, so there is no Run that looks
clickable above Stop, and Run is back, enabled, once the run ends; the
footer counts the run's slot ("1 of 2 run slots busy"; it kept the count from before the click). Before: the click's
own script run left Run drawn enabled for the whole run; then, with Run emptied from its slot, the browser still showed
it, stale, until that script run (the whole run) ended, as Streamlit's frontend keeps a replaced widget of the previous
script run; Run now sits in a block of its own. On the tiny model with each step slowed (tests/browser/
test_run_traps_browser.py's server).

At the click (issue 48, item 3): Run greys, one button in its place, until Stop takes it, on a server whose Run check
(the prompt's tokenisation) is slowed."""
from __future__ import annotations

import json
import os
import re

import pytest

from tests.browser.test_browser import wait_idle
from tests.browser.test_run_traps_browser import ROOT, open_app, slow_server  # noqa: F401  (a fixture)
from tests.helpers import streamlit_server

pytestmark = pytest.mark.browser
CHECK_S = 3.0                 # Run's check tokenises a prompt holding MARK this slowly (a long prompt, a busy server)
MARK = "(checked slowly)"
SLOW_CHECK = """import importlib, os, time
_g = importlib.import_module("engine.generate")
_ids, _s, _mark = _g.prompt_ids, float(os.environ["LLM_INSPECTOR_TEST_CHECK_S"]), os.environ["LLM_INSPECTOR_TEST_MARK"]


def _slow_ids(model, prompt, *args, **kwargs):
    if _mark in prompt:
        time.sleep(_s)
    return _ids(model, prompt, *args, **kwargs)


_g.prompt_ids = _slow_ids
"""
# Every change of the sidebar's visible Run and Stop buttons, as the DOM had it before each paint (a mutation
# observer's callback runs before the browser draws): [ms, [Run's disabled flag for each visible Run], Stops].
RECORD_BUTTONS = """() => {
  window.__buttons = [];
  const side = document.querySelector('[data-testid="stSidebar"]');
  const named = (name) => [...side.querySelectorAll('button')].filter(b => b.innerText.trim() === name
                                                                          && b.checkVisibility());
  const sample = () => {
    const now = [named('Run').map(b => b.disabled), named('Stop').length];
    const last = window.__buttons[window.__buttons.length - 1];
    if (!last || JSON.stringify(last.slice(1)) !== JSON.stringify(now))
      window.__buttons.push([performance.now(), ...now]);
  };
  sample();
  new MutationObserver(sample).observe(side, {subtree: true, childList: true, attributes: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def slow_check_url(tmp_path_factory, tiny_model_dir):
    hook = tmp_path_factory.mktemp("slow-check")
    (hook / "sitecustomize.py").write_text(SLOW_CHECK)
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir), LLM_INSPECTOR_TEST_CHECK_S=str(CHECK_S),
               LLM_INSPECTOR_TEST_MARK=MARK,
               PYTHONPATH=os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with streamlit_server(env, hook / "streamlit.log") as (url, _):
        yield url


def test_run_greys_at_the_click_one_button_in_its_place_until_stop_takes_it(browser, slow_check_url):
    """The click's script run draws Run greyed (its callback has taken the click before the sidebar is drawn), the
    same button in its place, while the run's check goes (CHECK_S, slowed); then Stop. Before: Run was drawn enabled
    by the click's own script run and stayed clickable until Stop came; the first attempt at greying drew a second,
    disabled Run beside the stale enabled one."""
    page = open_app(browser, slow_check_url)
    side = page.locator('[data-testid="stSidebar"]')
    side.locator("textarea").first.fill(f"Tell me a story {MARK}")
    side.locator("textarea").first.press("Tab")             # the prompt reaches the server (its estimate: slowed)
    wait_idle(page)
    run = side.get_by_role("button", name="Run", exact=True)
    assert run.count() == 1 and run.is_enabled()
    page.evaluate(RECORD_BUTTONS)
    clicked = page.evaluate("() => performance.now()")
    run.click()
    page.wait_for_function("() => window.__buttons.some(b => b[2] > 0)", timeout=60_000)   # Stop (the run is short)
    seen = page.evaluate("() => window.__buttons")
    shown = json.dumps(seen)
    assert all(len(runs) <= 1 for _, runs, _ in seen), f"two Run buttons at once: {shown}"
    after = [(t - clicked, runs, stops) for t, runs, stops in seen if t >= clicked]
    first_stop = next(k for k, (_, _, stops) in enumerate(after) if stops)   # (the run may have ended since)
    before_stop = [runs for _, runs, _ in after[:first_stop]]
    assert [True] in before_stop, f"Run was never greyed between the click and Stop: {shown}"
    greyed = before_stop.index([True])
    assert all(runs != [False] for runs in before_stop[greyed:]), f"an enabled Run came back before Stop: {shown}"
    assert after[first_stop][1] == [], f"Run beside Stop: {shown}"                # Stop took Run's place
    first_grey = next(t for t, runs, _ in after if runs == [True])
    first_stop = after[first_stop][0]
    print(f"Run greyed {first_grey:.0f} ms after the click; Stop {first_stop:.0f} ms after it (the check: {CHECK_S} s)")
    wait_idle(page, 120)
    assert run.count() == 1 and run.is_enabled()
    assert side.get_by_role("button", name="Stop", exact=True).count() == 0
    page.close()


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
