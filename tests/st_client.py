"""A browser session of the app spoken over Streamlit's WebSocket protocol, without painting.

It does what a tab does on the server: it asks for a run of the app (BackMsg.rerun_script: query string, page,
widget states), keeps the page the server pushes (every ForwardMsg: each delta at its path, the stale ones dropped
when a script run finishes, as the frontend drops them), and answers with the next interaction (a widget's new
value, a button's trigger, another page). What it does not do is draw: the server computes and sends exactly what
it sends to a browser, and the test reads the elements instead of the pixels. A class's own laptops draw their
pages; a test that puts thirty Chromium tabs on the server's two cores measures Chromium (README, Tests).

    student = AppClient(url)                 # its own cookie: a browser of its own
    student.wait_idle("the first page")
    student.set("Prompt", "Hello")           # a widget by its label: its value as that widget sends it
    student.click("Run")
    student.wait_for("Generated text")
    student.codes()                          # the main area's code blocks, in page order
    student.goto("Attention")                # a page by its title (st.navigation's pages)
    student.exceptions()                     # the messages of the exceptions the page shows
"""
from __future__ import annotations

import json
import re
import secrets
import threading
import time

from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

FINISHED, EARLY, FRAGMENT = 0, 2, 3       # ForwardMsg.ScriptFinishedStatus: a whole run, cut for a rerun, a fragment
TITLE = re.compile(r'"text":\s*"((?:[^"\\]|\\.)*)"')   # a figure's titles and annotations, in its JSON
QUIET_S = 0.4                             # a run is over once nothing more came for this long after it finished


class AppClient:
    def __init__(self, url: str, query: str = "", cookie: str | None = None, timeout_s: float = 240) -> None:
        """Connect to the app at url (http://host:port) and ask for its first run. cookie: the browser's
        `_streamlit_xsrf` (tabs of one browser share it); a fresh one by default."""
        from websockets.sync.client import connect
        self.query, self.timeout_s = query, timeout_s
        self.cookie = cookie or secrets.token_hex(16)
        self.cond = threading.Condition()
        self.elements: dict[tuple, tuple[int, object]] = {}   # delta path -> (stamp, Element or Block)
        self.pages: dict[str, str] = {}                        # page title -> page_script_hash
        self.page_hash = ""
        self.values: dict[str, tuple[str, object]] = {}       # widget id -> (WidgetState field, value), sent each run
        self.running = False
        self.finished = 0              # script runs finished (whole or fragment)
        self.last_message = time.monotonic()
        self.stamp = 0                 # counts script runs and fragment runs: what a finished run did not touch goes
        self.run_start = 0             # the stamp the current whole run began at
        self.fragments: set[str] = set()
        self.closed: BaseException | None = None
        self.sent = 0                  # runs finished when the last request went
        self.watchers: list = []       # fn(data, now) after each message, holding self.cond (watch())
        self.ws = connect(url.replace("http://", "ws://") + "/_stcore/stream", subprotocols=["streamlit"], proxy=None,
                          max_size=256 << 20, open_timeout=60,
                          additional_headers={"Cookie": f"_streamlit_xsrf={self.cookie}"})
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        self.rerun()

    # ---- what the server sends ----------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            for data in self.ws:
                msg = ForwardMsg()
                msg.ParseFromString(data)
                with self.cond:
                    self._take(msg)
                    self.last_message = time.monotonic()
                    for fn in self.watchers:
                        fn(data, time.time())
                    self.cond.notify_all()
        except Exception as e:          # the connection closed (the test's end, or the server went away)
            with self.cond:
                self.closed = e
                self.cond.notify_all()
        else:
            with self.cond:
                self.closed = ConnectionError("the server closed the connection")
                self.cond.notify_all()

    def _take(self, msg) -> None:
        kind = msg.WhichOneof("type")
        if kind == "new_session":                  # a whole run of the script begins
            self.stamp += 1
            self.run_start = self.stamp
            self.page_hash = msg.new_session.page_script_hash
            self._learn_pages(msg.new_session.app_pages)
        elif kind == "navigation":
            self._learn_pages(msg.navigation.app_pages)
            self.page_hash = msg.navigation.page_script_hash or self.page_hash
        elif kind == "session_status_changed":
            self.running = msg.session_status_changed.script_is_running
        elif kind == "delta":
            delta = msg.delta
            if delta.fragment_id and delta.fragment_id not in self.fragments and not self.running_whole():
                self.stamp += 1                    # a fragment's own run (no new_session before it)
                self.fragments.add(delta.fragment_id)
            which = delta.WhichOneof("type")
            if which in ("new_element", "add_block"):
                self.elements[tuple(msg.metadata.delta_path)] = (self.stamp, getattr(delta, which))
        elif kind == "script_finished":
            status = msg.script_finished
            if status == FINISHED:                 # whatever this run did not send is gone from the page
                self.elements = {p: e for p, e in self.elements.items() if e[0] >= self.run_start}
            elif status == FRAGMENT:               # the same within the fragments that ran: their stale siblings
                fresh = {p[:-1] for p, e in self.elements.items() if e[0] == self.stamp}
                self.elements = {p: e for p, e in self.elements.items() if e[0] == self.stamp or p[:-1] not in fresh}
                self.fragments.clear()
            self.finished += 1

    def running_whole(self) -> bool:
        return self.running and self.run_start == self.stamp

    def _learn_pages(self, app_pages) -> None:
        for p in app_pages:
            if p.page_name:
                self.pages[p.page_name] = p.page_script_hash

    # ---- what a tab sends ---------------------------------------------------------------------------------------
    def rerun(self, trigger: str | None = None) -> None:
        """Ask for a run of the current page with every value set so far (and one button's trigger)."""
        msg = BackMsg()
        state = msg.rerun_script
        state.query_string, state.page_script_hash = self.query, self.page_hash
        for wid, (field, value) in self.values.items():
            w = state.widget_states.widgets.add()
            w.id = wid
            if field.endswith("_array_value"):
                getattr(w, field).data.extend(value)
            else:
                setattr(w, field, value)
        if trigger is not None:
            w = state.widget_states.widgets.add()
            w.id, w.trigger_value = trigger, True
        with self.cond:
            self.sent = self.finished
        self.ws.send(msg.SerializeToString())

    def set(self, label: str, value, rerun: bool = True) -> None:
        """Give the widget labelled `label` a value, as its frontend sends it, and rerun (rerun=False: a widget in
        a form, sent with the form's submit button)."""
        kind, widget = self.widget(label)
        if kind in ("text_area", "text_input"):
            field, value = "string_value", str(value)
        elif kind == "number_input":
            field, value = ("int_value", int(value)) if widget.data_type == 0 else ("double_value", float(value))
        elif kind in ("selectbox", "radio"):
            assert value in widget.options, f"{label!r} has no option {value!r}: {list(widget.options)}"
            field = "string_value"
        elif kind == "slider":
            field, value = "double_array_value", [float(value)]
        elif kind == "checkbox":
            field, value = "bool_value", bool(value)
        else:
            raise AssertionError(f"{label!r} is a {kind}, which this client cannot set")
        self.values[widget.id] = (field, value)
        if rerun:
            self.rerun()

    def click(self, label: str) -> None:
        kind, widget = self.widget(label)
        assert kind == "button", f"{label!r} is a {kind}, not a button"
        assert not widget.disabled, f"the button {label!r} is disabled"
        self.rerun(trigger=widget.id)

    def goto(self, title: str) -> None:
        """Open a page by its title, as its link in the sidebar does."""
        assert title in self.pages, f"no page {title!r}: {sorted(self.pages)}"
        self.page_hash = self.pages[title]
        self.rerun()

    # ---- what the page shows ------------------------------------------------------------------------------------
    def widget(self, label: str, prefix: bool = False):
        """(kind, element) of the widget labelled `label` (prefix: whose label starts with it) on the page now (the
        first in page order)."""
        with self.cond:
            for _, element in self._ordered():
                kind = element.WhichOneof("type")
                inner = getattr(element, kind) if kind else None
                name = getattr(inner, "label", None) if inner is not None and getattr(inner, "id", "") else None
                if isinstance(name, str) and (name.startswith(label) if prefix else name == label):
                    return kind, inner
        raise AssertionError(f"no widget labelled {label!r} on the page; it shows {self.text()[:400]!r}")

    def shown_value(self, label: str) -> str:
        """What the select box or number box whose label starts with `label` shows (the value the server set, else
        its default)."""
        kind, w = self.widget(label, prefix=True)
        if kind == "selectbox":
            return w.raw_value if w.set_value else w.options[w.default] if w.options else ""
        if kind == "number_input":
            v = w.value if w.set_value else w.default
            return str(int(v)) if w.data_type == 0 else str(v)
        raise AssertionError(f"{label!r} is a {kind}: no shown value here")

    def watch(self, fn) -> None:
        """Call fn(data, now) after each message from the server (data: its bytes, now: time.time()), in the
        reader thread, holding this client's lock (so fn may read the page)."""
        with self.cond:
            self.watchers.append(fn)

    def _ordered(self) -> list[tuple[tuple, object]]:
        return sorted(((p, e) for p, (_, e) in self.elements.items()), key=lambda pe: pe[0])

    def texts(self, area: int | None = None) -> list[tuple[str, str]]:
        """(kind, text) of every element with text, in page order (area 0: the main area, 1: the sidebar)."""
        out = []
        with self.cond:
            for path, element in self._ordered():
                if area is not None and path[0] != area:
                    continue
                kind = element.WhichOneof("type")
                inner = getattr(element, kind) if kind else None
                text = _text_of(kind, inner)
                if text:
                    out.append((kind, text))
        return out

    def text(self, area: int | None = None) -> str:
        return "\n".join(t for _, t in self.texts(area))

    def codes(self) -> list[str]:
        """The main area's code blocks, in page order."""
        return [t.strip("\n") for k, t in self.texts(0) if k == "code"]

    def shows(self, pattern: str | re.Pattern, area: int | None = None) -> bool:
        text = self.text(area)
        return re.search(pattern, text) is not None if isinstance(pattern, re.Pattern) else pattern in text

    def exceptions(self) -> list[str]:
        return [t for k, t in self.texts() if k == "exception"]

    # ---- waits --------------------------------------------------------------------------------------------------
    def wait_idle(self, what: str, timeout_s: float | None = None) -> None:
        """Until the server has answered the last request: a run finished after it, none running, and nothing more
        pushed for QUIET_S (the app's own reruns: st.rerun after a run, a page's second pass)."""
        end = time.monotonic() + (timeout_s or self.timeout_s)
        with self.cond:
            while True:
                self._alive(what)
                now = time.monotonic()
                if self.finished > self.sent and not self.running and now - self.last_message >= QUIET_S:
                    return
                assert now < end, f"{what}: the server still runs this session's script after " \
                                  f"{timeout_s or self.timeout_s:.0f} s; the page shows {self.text()[-400:]!r}"
                self.cond.wait(0.1)

    def wait_for(self, pattern: str | re.Pattern, what: str | None = None, timeout_s: float | None = None,
                 area: int | None = None) -> None:
        """Until the page (area 0: its main area) shows `pattern` (a substring, or a compiled regular expression)."""
        limit = timeout_s or self.timeout_s
        end = time.monotonic() + limit
        with self.cond:
            while not self.shows(pattern, area):
                self._alive(what or str(pattern))
                assert time.monotonic() < end, \
                    f"{what or pattern!r} not shown after {limit:.0f} s; the page shows {self.text()[-400:]!r}"
                self.cond.wait(0.1)

    def _alive(self, what: str) -> None:
        assert self.closed is None, f"{what}: the connection closed ({self.closed!r})"

    def close(self) -> None:
        self.ws.close()
        self.thread.join(5)


MARKUP = re.compile(r"\\(.)|\*\*|__|`|\[([^\]]*)\]\([^)]*\)")     # an escape, bold, code, a link


def as_read(markdown: str) -> str:
    """Markdown as a reader sees it: escapes resolved, bold and code marks and link targets left out."""
    return MARKUP.sub(lambda m: m.group(1) or m.group(2) or "", markdown)


def _text_of(kind: str | None, inner) -> str:
    """The text an element shows (its body, its code, its message), or '' for one without text."""
    if kind in ("markdown", "heading", "alert"):
        return as_read(inner.body)
    if kind == "code":
        return inner.code_text
    if kind == "text":
        return inner.body
    if kind == "exception":
        return f"{inner.type}: {inner.message}"
    if kind == "progress":
        return inner.text
    if kind == "metric":
        return f"{inner.label} {inner.body}"
    if kind == "plotly_chart":          # a chart's titles and notes (the text a drawn chart shows)
        return "\n".join(json.loads(f'"{t}"') for t in TITLE.findall(inner.spec))
    return ""
