"""A forged browser cannot freeze the server with a long prompt (issue 19, item 1). The sidebar's text area has
max_chars, but that is the browser's own check: a client speaking Streamlit's WebSocket protocol sends whatever
widget value it likes (Streamlit 1.67, the pinned release, cuts it to max_chars on the server; the app checks
the length itself before anything is tokenized, whatever the release). Here one such session sends a 2 MB prompt
(the sidebar estimates a prompt's tokens on every rerun; tokenizing 2 MB holds the GIL for seconds) while
another connection asks /_stcore/health every 50 ms: every answer must come within 1.5 s."""
from __future__ import annotations

import threading
import time
import urllib.request

import pytest

from tests.helpers import streamlit_server

pytestmark = [pytest.mark.browser, pytest.mark.alone]      # its delays, schedule or memory: by itself (tests/alone.py)
PROMPT_KEY = "sb_prompt"
HEALTH_S = 1.5


class ForgedSession:
    """One session over /_stcore/stream without a browser: rerun the app with chosen widget values, read the
    ForwardMsgs it pushes."""

    def __init__(self, url: str) -> None:
        from websockets.sync.client import connect
        self.ws = connect(url.replace("http://", "ws://") + "/_stcore/stream", subprotocols=["streamlit"],
                          proxy=None, max_size=64 << 20, open_timeout=30)

    def rerun(self, widgets: dict[str, str] | None = None) -> None:
        from streamlit.proto.BackMsg_pb2 import BackMsg
        msg = BackMsg()
        msg.rerun_script.query_string = ""
        for wid, text in (widgets or {}).items():
            w = msg.rerun_script.widget_states.widgets.add()
            w.id, w.string_value = wid, text
        self.ws.send(msg.SerializeToString())

    def messages(self, until: float, to_the_end: bool = True):
        """ForwardMsgs as they come, until the script run finishes (to_the_end) or `until` (monotonic) passes."""
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
        while time.monotonic() < until:
            try:
                data = self.ws.recv(timeout=max(0.1, until - time.monotonic()))
            except TimeoutError:
                return
            msg = ForwardMsg()
            msg.ParseFromString(data)
            yield msg
            if to_the_end and msg.WhichOneof("type") == "script_finished":
                return

    def widget_id(self, key: str, until: float) -> str:
        """The id the server gave the text area whose key is `key` (ids end with the user's key)."""
        seen = []
        for msg in self.messages(until, to_the_end=False):
            seen.append(msg.WhichOneof("type"))
            if msg.WhichOneof("type") == "delta" and msg.delta.WhichOneof("type") == "new_element":
                el = msg.delta.new_element
                if el.WhichOneof("type") == "text_area" and el.text_area.id.endswith(key):
                    return el.text_area.id
        raise AssertionError(f"no text area with key {key!r} was drawn; messages: {seen[-40:]}")

    def close(self) -> None:
        self.ws.close()


def first_run(url: str) -> tuple[ForgedSession, str]:
    """A forged session whose first run has ended: (the session, the prompt widget's id)."""
    forged = ForgedSession(url)
    try:
        forged.rerun()
        wid = forged.widget_id(PROMPT_KEY, time.monotonic() + 120)
        list(forged.messages(time.monotonic() + 60))
    except BaseException:
        forged.close()
        raise
    return forged, wid


@pytest.fixture
def warm_server(tmp_path, tiny_model_dir):
    """The server started and a first session's run ended (the model loaded, the pages' modules imported), before
    the test's turn alone (tests/alone.py). That session is closed: a WebSocket left unread while the test waits
    for its turn can miss its keepalive (it did, once, after 36 s)."""
    import os
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir), LLM_INSPECTOR_MODEL_ROOTS="",
               LLM_INSPECTOR_HUB_CACHE="off", OMP_NUM_THREADS="1")
    with streamlit_server(env, tmp_path / "streamlit.log", "--server.fileWatcherType", "none") as (url, _):
        first_run(url)[0].close()
        yield url


def test_a_two_megabyte_prompt_from_a_forged_session_keeps_the_server_answering(warm_server):
    url = warm_server
    forged, wid = first_run(url)
    delays, failed, stop = [], [], threading.Event()

    def ask():
        """Every answer's delay, a request that failed or was still waiting included (its time so far)."""
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                body = urllib.request.urlopen(url + "/_stcore/health", timeout=30).read()
                if body != b"ok":
                    failed.append(f"answered {body[:80]!r}")
            except OSError as e:
                failed.append(repr(e))
            finally:
                delays.append(time.perf_counter() - t0)
            time.sleep(0.05)

    health = threading.Thread(target=ask, daemon=True)
    health.start()
    try:
        time.sleep(0.5)
        forged.rerun({wid: "The cat sat, " * 160_000})            # 2.1 MB, as the paste
        finished = [m.WhichOneof("type") for m in forged.messages(time.monotonic() + 60)][-1:]
        time.sleep(0.5)
    finally:
        stop.set()
        health.join(35)
        forged.close()
    assert not health.is_alive(), "a /_stcore/health request was still unanswered 35 s after the paste's run"
    assert not failed, f"/_stcore/health failed during the paste: {failed[:3]}"
    assert finished == ["script_finished"], "the forged session's run did not finish within 60 s"
    assert delays and max(delays) < HEALTH_S, f"/_stcore/health took up to {max(delays):.2f} s during the paste"
    print(f"\n/_stcore/health during a forged 2.1 MB prompt: {len(delays)} answers, "
          f"slowest {max(delays) * 1000:.0f} ms")
