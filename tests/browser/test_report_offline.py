"""The take-home report in a real browser with the network cut: the default report of the bundled model
(made by the CLI in its own process) is under 10 MB, every chart renders, no console error, and not one
request leaves the file; a hostile prompt runs no script and loads nothing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import engine_cli

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 10 * 2**20


def make_report(out: Path, *args: str, own_process: bool = True) -> dict:
    """`python -m engine report ARGS --out OUT` in its own process, or through its entry point in this one."""
    if own_process:
        r = subprocess.run([sys.executable, "-m", "engine", "report", *args, "--out", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    else:
        r = engine_cli("report", *args, "--out", str(out))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def chromium(browser):
    """The browser tier's Chromium (tests/browser/conftest.py); each check opens and closes its own context."""
    return browser


def open_offline(browser, path: Path) -> dict:
    """Open the file with every other request aborted; what left (or tried to), errors, dialogs, charts."""
    url = path.resolve().as_uri()
    ctx = browser.new_context()
    seen = {"blocked": [], "errors": [], "dialogs": []}

    def route(r):
        if r.request.url == url:
            r.continue_()
        else:
            seen["blocked"].append(r.request.url)
            r.abort()

    ctx.route("**/*", route)
    page = ctx.new_page()
    page.on("console", lambda m: seen["errors"].append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: seen["errors"].append(str(e)))
    page.on("requestfailed", lambda r: seen["blocked"].append(r.url) if r.url not in seen["blocked"] else None)
    page.on("dialog", lambda d: (seen["dialogs"].append(d.message), d.dismiss()))
    page.goto(url, wait_until="load")
    page.wait_for_function("Array.from(document.querySelectorAll('.chart')).every(d => d.querySelector('.main-svg'))",
                           timeout=60_000)
    page.wait_for_timeout(500)
    seen["charts"] = page.evaluate("document.querySelectorAll('.chart').length")
    seen["rendered"] = page.evaluate(
        "Array.from(document.querySelectorAll('.chart')).filter(d => d.querySelector('.main-svg')).length")
    seen["heatmaps"] = page.evaluate("document.querySelectorAll('.chart .hm, .chart image').length")
    seen["text"] = page.inner_text("body")
    ctx.close()
    return seen


def test_the_default_report_opens_offline_with_every_chart(chromium, tmp_path):
    out = tmp_path / "run.html"
    info = make_report(out, "What is the capital of France?", "--chat")
    assert info["bytes"] == out.stat().st_size < MAX_BYTES
    seen = open_offline(chromium, out)
    assert seen["blocked"] == [] and seen["errors"] == [] and seen["dialogs"] == []
    assert seen["charts"] == seen["rendered"] >= 9       # steps, 3 attention maps, 2 statistics, 3 sampling steps
    assert seen["heatmaps"] >= 3
    assert "Paris" in seen["text"] and "No NaN or Inf at any stage" in seen["text"]
    assert "python3 -m engine report 'What is the capital of France?' --chat" in seen["text"]


def test_a_hostile_prompt_runs_nothing_and_loads_nothing(chromium, tmp_path):
    out = tmp_path / "hostile.html"
    prompt = "</script><img src=x onerror=alert(1)><script>alert(2)</script> & <a href=http://example.com>x</a>"
    make_report(out, prompt, "--max-new-tokens", "4", "--layers", "0", "--steps", "0", own_process=False)
    seen = open_offline(chromium, out)
    assert seen["blocked"] == [] and seen["errors"] == [] and seen["dialogs"] == []
    assert seen["charts"] == seen["rendered"] and prompt in seen["text"]
