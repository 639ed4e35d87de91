"""Streamlit's toolbar Stop during a run (issue 21, item 1). While the sidebar watches a run, Streamlit offers its
own Stop (top right, the status widget); the browser then sends a BackMsg with `stop_script`, and the script
raises StopException at its next Streamlit call. That used to stop only the watching: the run went on unseen,
holding a run slot for minutes, and its result appeared at the next click. Now the stopped script stops the
run: the engine ends it at the next token (stop reason "stopped") and its slot is free within 2 s. A page
change (a new script run: RerunException) must not stop it: the new script run keeps watching.

The sessions speak Streamlit's WebSocket protocol (tests.browser.test_forged_prompt.ForgedSession) on the tiny
model with every generation step slowed (the sitecustomize of tests.browser.test_run_traps_browser), so that a
run of 32 tokens lasts about 13 s. A second session reads the sidebar's "Server: n of m run slots busy"."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from tests.browser.test_forged_prompt import ForgedSession
from tests.browser.test_run_traps_browser import SLOWER
from tests.helpers import streamlit_server

ROOT = Path(__file__).resolve().parents[2]
STEP_S = 0.4                 # each token (and the prefill) sleeps this long first
FREE_WITHIN_S = 2.0
pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def slow_url(tmp_path_factory, tiny_model_dir):
    hook = tmp_path_factory.mktemp("slow_stop")
    (hook / "sitecustomize.py").write_text(SLOWER)
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir), LLM_INSPECTOR_MODEL_ROOTS="",
               LLM_INSPECTOR_HUB_CACHE="off", OMP_NUM_THREADS="1", LLM_INSPECTOR_TEST_STEP_S=str(STEP_S),
               PYTHONPATH=os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with streamlit_server(env, hook / "streamlit.log", "--server.fileWatcherType", "none") as (url, _):
        yield url


class Session(ForgedSession):
    """A forged browser that also clicks buttons, switches pages, presses the toolbar's Stop, and reads what
    the app draws (texts of markdown, alerts and progress bars)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.ids: dict[str, str] = {}          # widget key -> id
        self.pages: dict[str, str] = {}        # url path -> page script hash

    def send(self, trigger: str | None = None, page: str | None = None) -> None:
        from streamlit.proto.BackMsg_pb2 import BackMsg
        msg = BackMsg()
        msg.rerun_script.query_string = ""
        if page is not None:
            msg.rerun_script.page_script_hash = self.pages[page]
        if trigger is not None:
            w = msg.rerun_script.widget_states.widgets.add()
            w.id, w.trigger_value = self.ids[trigger], True
        self.ws.send(msg.SerializeToString())

    def stop_script(self) -> None:
        """What the toolbar's Stop sends."""
        from streamlit.proto.BackMsg_pb2 import BackMsg
        msg = BackMsg()
        msg.stop_script = True
        self.ws.send(msg.SerializeToString())

    def texts(self, seconds: float, until: str | None = None, to_the_end: bool = True) -> list[str]:
        """The texts drawn over `seconds`, until a text matches `until` or (to_the_end) a script run ends
        other than for a rerun (an app's st.rerun, a page change)."""
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
        seen = []
        for msg in self.messages(time.monotonic() + seconds, to_the_end=False):
            kind = msg.WhichOneof("type")
            if (kind == "script_finished" and to_the_end
                    and msg.script_finished != ForwardMsg.ScriptFinishedStatus.FINISHED_EARLY_FOR_RERUN):
                return seen                    # a script run that was not replaced by a newer one ended
            if kind == "navigation":
                self.pages |= {p.url_pathname: p.page_script_hash for p in msg.navigation.app_pages}
            if kind != "delta" or msg.delta.WhichOneof("type") != "new_element":
                continue
            el = msg.delta.new_element
            what = el.WhichOneof("type")
            if what in ("button", "text_area", "number_input"):
                widget = getattr(el, what)
                self.ids[widget.id.rsplit("-", 1)[-1]] = widget.id
            text = {"markdown": el.markdown.body, "alert": el.alert.body, "progress": el.progress.text}.get(what)
            if text:
                seen.append(text)
                if until is not None and re.search(until, text):
                    return seen
        return seen


def busy_slots(observer: Session) -> int:
    observer.send()
    caption = [t for t in observer.texts(60) if t.startswith("Server: ")]
    assert caption, "the sidebar's server caption was not drawn"
    return int(re.match(r"Server: (\d+) of", caption[-1]).group(1))


def open_session(url: str) -> Session:
    s = Session(url)
    s.send()
    s.texts(180)                               # the first script run (the model loads) draws Run
    assert "sb_run" in s.ids and "" in s.pages, (s.ids, s.pages)
    return s


def start_run(s: Session) -> int:
    """Click Run; the token number the progress bar showed once the run was decoding."""
    s.send(trigger="sb_run")
    shown = s.texts(60, until=r"^token [3-9] of at most 32", to_the_end=False)
    assert shown and shown[-1].startswith("token "), shown[-10:]
    return int(shown[-1].split()[1])


def test_the_toolbar_stop_stops_the_run_and_frees_its_slot(slow_url):
    student, observer = open_session(slow_url), open_session(slow_url)
    try:
        assert busy_slots(observer) == 0
        start_run(student)
        assert busy_slots(observer) == 1
        student.stop_script()
        stopped_at = time.monotonic()
        student.texts(10)                        # the script run ends (StopException)
        time.sleep(max(0.0, stopped_at + FREE_WITHIN_S - time.monotonic()))
        assert busy_slots(observer) == 0, f"the run still holds its slot {FREE_WITHIN_S} s after the toolbar's Stop"
        student.send()                           # the next click keeps the stopped run and says so
        said = student.texts(10, until=r"^Stopped after \d+ tokens")
        assert said and said[-1].startswith("Stopped after"), said[-10:]
        kept = int(said[-1].split()[2])
        assert 3 <= kept < 32, said[-1]
    finally:
        student.close()
        observer.close()


def test_a_page_change_during_a_run_keeps_it_going(slow_url):
    student, observer = open_session(slow_url), open_session(slow_url)
    try:
        at_switch = start_run(student)
        student.send(page="tokens")              # the page link's rerun: a new script run watches on
        shown = student.texts(60)                # until the run ends and the app is drawn again
        tokens = [int(t.split()[1]) for t in shown if re.match(r"^token \d+ of at most 32", t)]
        assert tokens and max(tokens) > at_switch + 3, "\n".join(shown)       # it kept generating, watched
        assert not [t for t in shown if t.startswith("Stopped")], shown
        assert busy_slots(observer) == 0
    finally:
        student.close()
        observer.close()
