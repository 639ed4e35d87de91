"""How fast a room's students follow, measured where the server's part ends: at the WebSocket (issue 19, item
10). Two app servers (`streamlit run app.py`, 127.0.0.1) share one real redis-server; 30 students, half on each
server, are WebSocket clients that speak Streamlit's protocol (a BackMsg asking for a run of the app at
`/?room=CODE`, then every ForwardMsg the server pushes), as a browser does but without painting: a
student's own laptop does the painting. The teacher's changes are published the way the teacher's process
publishes them (RoomStore.publish with the room's token: a run as trace bytes, then views); the delay runs
from the publish to the first message in which a student's session draws the new state (the room's line
naming the teacher's page, layer, head and step; the new run's prompt).

While the class opens the link, the room's redis-server is paused (SIGSTOP) for PAUSE_S, longer on a machine so
loaded that no screen has met the pause by then (at most PAUSE_MAX_S): the screens that meet it say that the
store does not answer, every student must still join by itself once it answers, and neither server may log a
traceback. (CI once saw eight of thirty students never join: a link's join that met the store's timeout was not
tried again, a screen that joined just before the store stopped answering was not watched, and the timeout closed
connections other sessions were reading, crashing their pages; docs/CLASSROOM.md, "When the store stops or
restarts".)

The issue's target is p95 <= 1.0 s over every change and student; the line printed says whether it was met.
Measured here (two servers and 30 students on one idle 2-core machine), with the students' sessions sharing
what their pages derive from the room's run (inspector.session.memo.SHARED): p95 0.84-1.06 s over seven runs
(2.1-2.4 s before it). The bound asserted is what a loaded CI machine holds with a margin;
LLM_INSPECTOR_LATENCY_P95_S=1.0 checks the target itself (docs/CLASSROOM.md, "How fast students follow")."""
from __future__ import annotations

import os
import secrets
import threading
import time

import psutil
import pytest

from engine import RunSettings
from engine.inspection.trace import to_bytes
from inspector.session.rooms import RoomStore
from inspector.session.rooms_redis import RedisBackend
from inspector.session.rooms_state import View
from inspector.session.run import inspect_run
from tests.browser.test_rooms import p95, redis_room_servers

pytestmark = [pytest.mark.browser, pytest.mark.alone]      # its delays, schedule or memory: by itself (tests/alone.py)
STUDENTS = int(os.environ.get("LLM_INSPECTOR_LATENCY_STUDENTS", "30"))
TARGET_S = 1.0
P95_S = float(os.environ.get("LLM_INSPECTOR_LATENCY_P95_S", "8"))
PAUSE_S = 2.0                     # the store stops answering for this long while two thirds of the class join,
PAUSE_MAX_S = 30.0                # or until a student's screen says so, if that comes later
OUTAGE = b"store does not answer"  # what a screen says then (joining, or following: reconnecting)
WAIT_S = 60                       # the most one change may take to reach every student before the test fails
TITLES = {"overview": "Overview", "attention": "Attention", "sampling": "Sampling"}
CHANGES = [View("attention"), View("attention", layer=1), View("attention", layer=1, head=2),
           View("sampling", layer=1, head=2), View("sampling", step=3, layer=1, head=2),
           View("sampling", step=5, layer=1, head=2), View("overview", step=5, layer=1, head=2)]


def line(view: View) -> str:
    """The room's line on a following student's screen (inspector.ui.room.describe)."""
    head = "average of heads" if view.head is None else f"head {view.head}"
    return f"following the teacher: {TITLES[view.page]} · layer {view.layer} · {head} · step {view.step}"


class Student:
    """One student's session over Streamlit's WebSocket: asks for the app at /?room=CODE once, then records
    when a pushed message first holds the text it waits for."""

    def __init__(self, base: str, code: str, want: str | None = None) -> None:
        from streamlit.proto.BackMsg_pb2 import BackMsg
        from websockets.sync.client import connect
        # each student is a browser of their own, with Streamlit's cookie (sessions without one count as one
        # browser together: LLM_INSPECTOR_MAX_SESSIONS_PER_CLIENT of them, docs/CLASSROOM.md)
        cookie = {"Cookie": f"_streamlit_xsrf={secrets.token_hex(16)}"}
        self.want = None if want is None else want.encode()   # set before the first message can arrive
        self.seen: float | None = None
        self.messages = 0
        self.outage = False                          # a message said that the room's store does not answer
        self.cond = threading.Condition()
        self.ws = connect(base.replace("http://", "ws://") + "/_stcore/stream", subprotocols=["streamlit"],
                          proxy=None, max_size=64 << 20, open_timeout=30, additional_headers=cookie)
        msg = BackMsg()
        msg.rerun_script.query_string = f"room={code}"
        self.ws.send(msg.SerializeToString())
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for data in self.ws:
                now = time.perf_counter()
                with self.cond:
                    self.messages += 1
                    self.outage = self.outage or OUTAGE in data
                    if self.want is not None and self.seen is None and self.want in data:
                        self.seen = now
                        self.cond.notify_all()
        except Exception:            # the connection closed at the end of the test
            pass

    def expect(self, text: str) -> None:
        with self.cond:
            self.want, self.seen = text.encode(), None

    def wait(self, deadline: float) -> float | None:
        with self.cond:
            while self.seen is None and time.monotonic() < deadline:
                self.cond.wait(0.05)
            return self.seen

    def close(self) -> None:
        self.ws.close()
        self.thread.join(5)


def pause_store(url: str, students: list, seconds: float, longest: float) -> float:
    """Stop the room's redis-server (SIGSTOP): it holds every connection and answers nothing, for `seconds` and
    until one of `students` was told so (at most `longest`); how long it was paused."""
    sock = url.removeprefix("unix://")
    redis = [p for p in psutil.process_iter(["name", "cmdline"])
             if p.info["name"] == "redis-server" and sock in " ".join(p.info["cmdline"] or [])]
    assert len(redis) == 1, redis
    t0 = time.monotonic()
    redis[0].suspend()
    try:
        time.sleep(seconds)
        while not any(s.outage for s in list(students)) and time.monotonic() < t0 + longest:
            time.sleep(0.05)
    finally:
        redis[0].resume()
    return time.monotonic() - t0


def change(store, code, token, students, publish: dict, text: str) -> list[float]:
    """Publish one change; seconds from the publish to each student's session drawing `text`."""
    for s in students:
        s.expect(text)
    t0 = time.perf_counter()
    store.publish(code, token, **publish)
    deadline = time.monotonic() + WAIT_S
    seen = [s.wait(deadline) for s in students]
    late = [k for k, t in enumerate(seen) if t is None]
    assert not late, f"students {late} never drew {text!r} within {WAIT_S} s"
    time.sleep(0.3)                                    # every rerun this change caused has ended
    return [t - t0 for t in seen]


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory, tiny_model_dir):
    with redis_room_servers(tmp_path_factory.mktemp("room-latency"), tiny_model_dir) as (url, servers):
        yield url, servers


@pytest.fixture
def joined(two_servers, tiny_model):
    """The room made, its first run published and the class joined while the store paused, before the test's
    turn alone (tests/alone.py): (store, code, token, students, runs, seconds paused, students told)."""
    url, servers = two_servers
    store = RoomStore(RedisBackend.from_url(url, timeout=5))
    code, token = store.create()
    runs = [inspect_run(tiny_model, RunSettings(prompt=p, chat=False, max_new_tokens=8))
            for p in ("Tell me a story about a lighthouse.", "What is the capital of France?")]
    store.publish(code, token, run=to_bytes(runs[0]), view=View())
    t0 = time.monotonic()
    students, paused = [], []
    pause = threading.Thread(target=lambda: paused.append(pause_store(url, students, PAUSE_S, PAUSE_MAX_S)))
    try:
        for k in range(STUDENTS):
            if k == STUDENTS // 3:
                pause.start()          # the store pauses while the class opens the link
            students.append(Student(servers[k % 2][0], code, line(View())))
        pause.join()
        assert paused, "the room's redis-server could not be paused (see the thread's exception above)"
        missing = [k for k, s in enumerate(students) if s.wait(t0 + 180) is None]
        assert not missing, f"students {missing} never joined the room"
        told = sum(s.outage for s in students)
        assert told, "no student's screen met the store's pause: the join under a pause was not exercised"
        time.sleep(1.0)
        yield store, code, token, students, runs, paused[0], told
    finally:
        for s in students:                    # the test closes them itself; again here if it did not get to
            s.close()


def test_thirty_websocket_students_follow_within_a_second(two_servers, joined):
    _, servers = two_servers
    store, code, token, students, runs, paused, told = joined
    delays: dict[str, list[float]] = {}
    try:
        for view in CHANGES:
            delays[line(view).split(": ", 1)[1]] = change(store, code, token, students, {"view": view}, line(view))
        delays["a new run"] = change(store, code, token, students, {"run": to_bytes(runs[1])},
                                     runs[1].settings.prompt)
    finally:
        for s in students:                    # closed in the call, not left open while others' calls measure
            s.close()
    every = [d for ds in delays.values() for d in ds]
    print(f"\nThe store paused {paused:.1f} s while they joined: {told} students were told it does not answer; all "
          f"joined. {STUDENTS} WebSocket students on two servers, one Redis, {len(delays)} changes: from the publish "
          f"to each student's session drawing it, p95 {p95(every):.3f} s, median "
          f"{sorted(every)[len(every) // 2]:.3f} s, max {max(every):.3f} s. Per change (p95): "
          + "; ".join(f"{k} {p95(v):.3f} s" for k, v in delays.items())
          + f". Target p95 <= {TARGET_S} s: {'met' if p95(every) <= TARGET_S else 'NOT met'} on this machine "
          f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}).")
    assert p95(every) <= P95_S, delays
    for _, proc, log in servers:
        assert proc.poll() is None and "Traceback" not in log.read_text()
