"""A room lesson's students (tests/browser/test_rooms.py): TabStudent, a Chromium tab, and WireStudent, a session that
speaks Streamlit's protocol (tests/st_client.py) instead of painting, with the same operations, so that a lesson
mixes both. The times it reports are those of the
tab's watcher: "delivered" when a message holding the teacher's first wanted text arrives, "shown" when the page
the server sent holds every wanted text and widget value, "full" when it also holds the charts' texts (a tab: once
drawn; here: once sent, the student's own laptop drawing it)."""
from __future__ import annotations

import re
import time
from ast import literal_eval

from tests.browser.room_tabs import (
    TIMEOUT_S,
    WATCH,
    generated_text,
    generations,
    go,
    idle,
    main_text,
    open_tab,
    pick,
    wait_text,
)
from tests.st_client import AppClient, as_read

PICK = "The model's top candidates"
TYPED = "or type your guess"


class TabStudent:
    """A student in a Chromium tab of its own (the operations room_students.WireStudent shares)."""

    def __init__(self, browser, url: str) -> None:
        self.ctx, self.page = open_tab(browser, url)

    def arm(self, want: list[str], widgets, full) -> None:
        self.page.evaluate(WATCH, [want, [list(w) for w in widgets], list(full)])

    def seen(self):
        return self.page.evaluate("() => window.__full && [window.__delivered || window.__seen, window.__seen, "
                                  "window.__full]")

    def wait_text(self, text: str, timeout_s: float = TIMEOUT_S) -> None:
        wait_text(self.page, text, timeout_s)

    def main_text(self) -> str:
        return main_text(self.page)

    def idle(self) -> None:
        idle(self.page)

    def generated_text(self) -> str:
        return generated_text(self.page)

    def generations(self) -> int:
        return generations(self.page)

    def click(self, name: str) -> None:
        self.page.get_by_role("button", name=name).click()

    def go(self, title: str) -> None:
        go(self.page, title)

    def pick(self, label: str, option: str) -> None:
        pick(self.page, label, option)

    def poll_candidates(self) -> list[str]:
        labels = [lab.strip() for lab in self.page.get_by_role("radiogroup").first.inner_text().split("\n")]
        return [literal_eval(lab) for lab in labels if lab and lab != "(none)"]

    def answer(self, pick: str | None = None, typed: str | None = None) -> None:
        if pick is not None:
            self.page.get_by_role("radiogroup").first.get_by_text(repr(pick), exact=True).click()
        else:
            self.page.get_by_label("or type your guess").fill(typed)
        self.page.get_by_role("button", name="Answer", exact=True).click()

    def line(self, pattern: str) -> str:
        return self.page.get_by_text(re.compile(pattern)).first.text_content()

    def exceptions(self) -> int:
        return self.page.locator('[data-testid="stException"]').count()

    def close(self) -> None:
        self.ctx.close()


class WireStudent:
    def __init__(self, url: str, timeout_s: float) -> None:
        base, _, query = url.partition("?")
        self.client = AppClient(base.rstrip("/"), query=query, timeout_s=timeout_s)
        self.want: tuple | None = None
        self.times: list[float | None] = [None, None, None]        # delivered, shown, full (ms since the epoch)
        self.client.watch(self._check)

    # ---- the lesson's watcher ---------------------------------------------------------------------------------
    def arm(self, want: list[str], widgets, full) -> None:
        with self.client.cond:
            self.want, self.times = (list(want), [tuple(w) for w in widgets], list(full)), [None, None, None]
            self._check(b"", time.time())           # what the page already shows counts at once, as in a tab

    def _check(self, data: bytes, now: float) -> None:
        if self.want is None:
            return
        want, widgets, full = self.want
        ms = now * 1000
        if self.times[0] is None and data and want[0].encode() in data:
            self.times[0] = ms
        if self.times[1] is None:
            text = self.client.text(0)
            if all(w in text for w in want) and all(self._shows(label, value) for label, value in widgets):
                self.times[1] = ms
        if self.times[1] is not None and self.times[2] is None and all(f in self.client.text(0) for f in full):
            self.times[2] = ms

    def _shows(self, label: str, value: str) -> bool:
        try:
            return self.client.shown_value(label) == value
        except AssertionError:                   # not on the page (yet)
            return False

    def seen(self) -> tuple[float, float, float] | None:
        """(delivered or shown, shown, full) in ms since the epoch, once everything is there."""
        with self.client.cond:
            d, s, f = self.times
            return None if f is None else (d or s, s, f)

    # ---- what a student does and sees -------------------------------------------------------------------------
    def wait_text(self, text: str, timeout_s: float | None = None) -> None:
        self.client.wait_for(text, timeout_s=timeout_s, area=0)

    def main_text(self) -> str:
        return self.client.text(0)

    def idle(self) -> None:
        self.client.wait_idle("the student's page")

    def generated_text(self) -> str:
        codes = self.client.codes()
        return codes[1] if len(codes) > 1 else ""

    def generations(self) -> int:
        return int(re.search(r"model generations: (\d+)", self.client.text()).group(1))

    def click(self, name: str) -> None:
        self.client.click(name)

    def go(self, title: str) -> None:
        self.client.goto(title)

    def pick(self, label: str, option: str) -> None:
        self.client.set(label, option)

    def poll_candidates(self) -> list[str]:
        _, radio = self.client.widget(PICK)
        return [literal_eval(as_read(o)) for o in radio.options if o != "(none)"]   # options are Markdown

    def answer(self, pick: str | None = None, typed: str | None = None) -> None:
        """Answer the poll: a candidate, or a typed word; the form's Answer button sends it."""
        if pick is not None:
            _, radio = self.client.widget(PICK)
            option = next(o for o in radio.options if o != "(none)" and literal_eval(as_read(o)) == pick)
            self.client.set(PICK, option, rerun=False)
        else:
            self.client.set(TYPED, typed, rerun=False)
        self.client.click("Answer")

    def line(self, pattern: str) -> str:
        """The first text on the page that starts with the pattern (a regular expression)."""
        return next(t for _, t in self.client.texts() if re.match(pattern, t))

    def exceptions(self) -> int:
        return len(self.client.exceptions())

    def close(self) -> None:
        self.client.close()
