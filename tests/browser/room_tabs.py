"""Driving the app in a Chromium tab, for the room tests: a tab of its own (motion off, nothing from outside), the
teacher's controls (the key, a room, a run) and what a tab shows; DELIVERY and WATCH time when the teacher's
selection reaches a tab and when it is on its screen (tests/browser/test_rooms.py, follow_delays)."""
from __future__ import annotations

import re
import time

import psutil

from tests.helpers import RUNNING

KEY = "teacher-key-for-tests"
TIMEOUT_S = 180


# ---- driving the app ---------------------------------------------------------------------------------------
NO_MOTION = "*, *::before, *::after { animation: none !important; transition: none !important; }"


def open_tab(browser, url: str, viewport=(1024, 720)):
    """A tab of its own (a context: its own cookies, so its own session). Eleven Chromium tabs share this
    machine's two cores with the server: motion is turned off (prefers-reduced-motion, no CSS animations) so
    that the tabs spend their CPU on what the app shows."""
    ctx = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]}, reduced_motion="reduce")
    ctx.add_init_script(f"document.addEventListener('DOMContentLoaded', () => {{ const s = "
                        f"document.createElement('style'); s.textContent = {NO_MOTION!r}; "
                        f"document.head.appendChild(s); }});")
    ctx.add_init_script(DELIVERY)
    page = ctx.new_page()
    page.route(re.compile(r"^(?!https?://127\.0\.0\.1[:/]).*"), lambda route: route.abort())   # nothing else
    page.goto(url, timeout=TIMEOUT_S * 1000, wait_until="commit")
    return ctx, page


def browsers_behind_servers() -> None:
    """Run this test's Chromium processes at a lower priority than the app servers: the tabs stand in for the
    students' own computers, so they must not take the server's CPU (they still take all that is left)."""
    for proc in psutil.Process().children(recursive=True):
        try:
            if "chrom" in proc.name().lower() and proc.nice() < 10:
                proc.nice(10)
        except psutil.Error:
            pass


def ready(page) -> None:
    page.get_by_role("textbox", name="Prompt", exact=True).wait_for(timeout=TIMEOUT_S * 1000)


def idle(page, timeout_s: float = TIMEOUT_S) -> None:
    """Until the app has processed what this tab sent (Streamlit's running indicator gone for a moment)."""
    end, quiet = time.monotonic() + timeout_s, 0
    while time.monotonic() < end:
        quiet = 0 if page.locator(RUNNING).count() else quiet + 1
        if quiet >= 3:
            return
        page.wait_for_timeout(150)
    raise AssertionError("the app was still running")


def main_text(page) -> str:
    return page.inner_text('[data-testid="stMain"]')


def wait_text(page, text: str, timeout_s: float = TIMEOUT_S) -> None:
    page.locator('[data-testid="stMain"]').get_by_text(text, exact=False).first.wait_for(timeout=timeout_s * 1000)


def start_room(page) -> str:
    """Enter the teacher key, start a room; its code."""
    ready(page)
    idle(page)
    page.get_by_text("Classroom: rooms and polls").click()
    key = page.get_by_role("textbox", name="Teacher key")
    key.fill(KEY)
    key.press("Enter")
    idle(page)
    page.get_by_role("button", name="I am the teacher").click()
    page.get_by_role("button", name="Start a room").click()
    wait_text(page, "students open")
    return re.search(r"Room ([2-9A-HJ-NP-Z]{6})", main_text(page)).group(1)


def run_prompt(page, prompt: str) -> str:
    """Type a prompt, press Run; the generated text the teacher's Overview shows. (The generation settings are
    left alone: in headless Chromium, opening that expander sets its sliders to their minimums.)"""
    idle(page)                       # max new tokens: the server's limit (NEW_TOKENS), the sidebar's default
    box = page.get_by_role("textbox", name="Prompt", exact=True)
    box.fill(prompt)
    box.press("Control+Enter")
    idle(page)
    page.get_by_role("button", name="Run", exact=True).click()
    wait_text(page, prompt)          # this run's Overview (the previous run's also says "Generated text")
    page.get_by_text("Generated text", exact=True).wait_for(timeout=TIMEOUT_S * 1000)
    idle(page)
    return generated_text(page)


def generated_text(page) -> str:
    """The text in Overview's "Generated text" box (the second code block, after the prompt)."""
    return page.locator('[data-testid="stMain"] [data-testid="stCode"] code').nth(1).text_content().strip("\n")


def go(page, title: str) -> None:
    page.locator('[data-testid="stSidebar"]').get_by_role("link", name=title, exact=True).first.click()


def pick(page, label: str, option: str) -> None:
    page.get_by_label(label, exact=True).first.click()
    page.get_by_role("option", name=option, exact=True).click()


def set_number(page, label: str, value: int) -> None:
    box = page.get_by_label(label, exact=False).first
    box.fill(str(value))
    box.press("Enter")


def generations(page) -> int:
    cap = page.get_by_text(re.compile(r"model generations: \d+")).first.text_content(timeout=TIMEOUT_S * 1000)
    return int(re.search(r"model generations: (\d+)", cap).group(1))


# When the teacher's selection reaches a tab: Streamlit's WebSocket is wrapped so that the first message
# holding the wanted text (the room line, e.g. "following the teacher: Attention · layer 1") is timed as it
# arrives, before the browser renders anything.
DELIVERY = """(() => { const WS = window.WebSocket; window.__wsWant = null; window.__delivered = null;
  const decoder = new TextDecoder("utf-8");
  window.WebSocket = function (...args) { const ws = new WS(...args);
    ws.addEventListener("message", (ev) => {
      if (!window.__wsWant || window.__delivered || !(ev.data instanceof ArrayBuffer)) return;
      if (decoder.decode(ev.data).includes(window.__wsWant)) window.__delivered = Date.now(); });
    return ws; };
  window.WebSocket.prototype = WS.prototype;
  for (const k of ["CONNECTING", "OPEN", "CLOSING", "CLOSED"]) window.WebSocket[k] = WS[k]; })();"""

# Each student tab records (Date.now()) when its screen shows the teacher's selection — every `want` text in
# the main area and every widget at the wanted value (a select box's shown option, a number box's value) —
# and, separately, when the `full` texts are there too (charts drawn: their titles are SVG text).
WATCH = """([want, widgets, full]) => { window.__want = [want, widgets, full]; window.__seen = null;
  window.__full = null; window.__delivered = null; window.__wsWant = want[0];
  const shown = (label, value) => Array.from(document.querySelectorAll(
      '[data-testid="stSelectbox"], [data-testid="stNumberInput"]')).some(e => {
    const lines = e.innerText.split("\\n").map(x => x.trim());
    const input = e.querySelector("input");
    return lines[0].startsWith(label) && (lines.includes(value) || (input && input.value === value)); });
  if (!window.__timer) window.__timer = setInterval(() => {
    if (!window.__want) return;
    const [w, ws, f] = window.__want;
    const main = document.querySelector('[data-testid="stMain"]');
    if (!main) return;
    const text = main.textContent;         // textContent: no layout forced, unlike innerText
    if (!window.__seen && w.every(x => text.includes(x)) && ws.every(([l, v]) => shown(l, v)))
      window.__seen = Date.now();
    if (window.__seen && !window.__full && f.every(x => text.includes(x))) window.__full = Date.now(); }, 50); }"""
