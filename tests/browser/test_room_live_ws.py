"""The teacher's run reaches the students while it generates (issue 23, item 1), measured at the WebSocket as
in test_room_latency: two app servers share one real redis-server, STUDENTS WebSocket clients (half on each)
follow a room. The teacher's side is what the teacher's server does when Run is pressed in a room
(RoomStore.start_live, then a LivePublisher that the LiveRun tells each progress record and token), here
driving a real generation of the tiny model at a lesson's pace (TOKEN_S a token: a real model on a CPU). Each
student's session must draw a growing text ("token k of at most N" with k rising), and the delay from the
teacher's server publishing token k to each student's session drawing it is printed."""
from __future__ import annotations

import os
import re
import threading
import time

import pytest

from engine import RunSettings
from engine.inspection.trace import to_bytes
from inspector.session.limits import Limits
from inspector.session.live_run import LiveRun
from inspector.session.rooms import RoomStore
from inspector.session.rooms_live import LivePublisher
from inspector.session.rooms_redis import RedisBackend
from inspector.session.rooms_state import View
from inspector.session.run import inspect_run
from tests.browser.test_room_latency import Student
from tests.browser.test_rooms import NEW_TOKENS, p95, redis_room_servers

pytestmark = [pytest.mark.browser, pytest.mark.alone]      # its delays, schedule or memory: by itself (tests/alone.py)
STUDENTS = int(os.environ.get("LLM_INSPECTOR_LIVE_STUDENTS", "10"))
P95_S = float(os.environ.get("LLM_INSPECTOR_LIVE_P95_S", "6"))
MAX_NEW, TOKEN_S = NEW_TOKENS, 0.25       # the test servers keep runs of at most NEW_TOKENS tokens
COUNT = re.compile(rb"token (\d+) of at most %d" % MAX_NEW)


class LiveStudent(Student):
    """A student that records when each "token k" first reached its session."""

    def __init__(self, base: str, code: str, want: str) -> None:
        self.firsts: dict[int, float] = {}
        super().__init__(base, code, want)

    def _read(self) -> None:
        try:
            for data in self.ws:
                now = time.perf_counter()
                with self.cond:
                    self.messages += 1
                    for m in COUNT.finditer(data):
                        self.firsts.setdefault(int(m.group(1)), now)
                    if self.want is not None and self.seen is None and self.want in data:
                        self.seen = now
                        self.cond.notify_all()
        except Exception:            # the connection closed at the end of the test
            pass


class Paced:
    """The publisher, told at a lesson's pace (the run's thread sleeps TOKEN_S at each token), with the time
    each token count was published."""

    def __init__(self, publisher: LivePublisher) -> None:
        self.p, self.published = publisher, {}
        real = publisher.publish

        def publish(doc):
            n = real(doc)
            self.published.setdefault(doc.tokens, time.perf_counter())
            return n
        publisher.publish = publish

    def progress(self, f):
        self.p.progress(f)

    def token(self, step):
        time.sleep(TOKEN_S)
        self.p.token(step)

    def finished(self, kept, stopped):
        self.p.finished(kept, stopped)


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory, tiny_model_dir):
    with redis_room_servers(tmp_path_factory.mktemp("room-live"), tiny_model_dir) as (url, servers):
        yield url, servers


@pytest.fixture
def joined(two_servers, tiny_model):
    """The room made, a first run published and the students joined, before the test's turn alone
    (tests/alone.py): (store, code, token, students)."""
    url, servers = two_servers
    store = RoomStore(RedisBackend.from_url(url, timeout=5))
    code, token = store.create()
    first = inspect_run(tiny_model, RunSettings(prompt="What is the capital of France?", chat=False, max_new_tokens=4))
    store.publish(code, token, run=to_bytes(first), view=View())
    t0 = time.monotonic()
    students = []
    try:
        for k in range(STUDENTS):
            students.append(LiveStudent(servers[k % 2][0], code, "following the teacher"))
        missing = [k for k, s in enumerate(students) if s.wait(t0 + 180) is None]
        assert not missing, f"students {missing} never joined the room"
        time.sleep(1.0)
        yield store, code, token, students
    finally:
        for s in students:
            s.close()
        threading.Event().wait(0.1)


def test_students_see_the_teachers_run_grow_token_by_token(two_servers, tiny_model, joined):
    _, servers = two_servers
    store, code, token, students = joined
    try:
        settings = RunSettings(prompt="Tell me a story about a lighthouse.", chat=False, max_new_tokens=MAX_NEW,
                               ignore_eos=True)
        live = store.start_live(code, token, settings.prompt, MAX_NEW)
        paced = Paced(LivePublisher(live.seq, settings.prompt, MAX_NEW,
                                    publish=lambda doc: store.publish_live(code, token, doc),
                                    end=lambda seq: store.end_live(code, token, seq)))
        run = LiveRun(settings, tiny_model.name, 0, observer=paced).start(tiny_model, Limits())
        assert run.wait(120) and run.error is None, run.error
        time.sleep(1.5)                                    # the last token reaches every screen
        for s in students:
            s.expect(settings.prompt)
        store.publish(code, token, run=to_bytes(run.record))   # the whole run, as the teacher's screen publishes it
        deadline = time.monotonic() + 30
        late = [k for k, s in enumerate(students) if s.wait(deadline) is None]
        assert not late, f"students {late} never drew the finished run"
    finally:
        for s in students:                    # closed in the call, not left open while others' calls measure
            s.close()
    delays = [s.firsts[k] - paced.published[k] for s in students for k in s.firsts if k in paced.published]
    for k, s in enumerate(students):
        seen = sorted(s.firsts)
        assert len(seen) >= 5 and seen[-1] == MAX_NEW, f"student {k} saw token counts {seen}: not a growing text"
        times = [s.firsts[n] for n in seen]
        assert times == sorted(times), f"student {k}: token counts arrived out of order"
    print(f"\n{STUDENTS} WebSocket students on two servers, one Redis; the teacher's run of {MAX_NEW} tokens at "
          f"{1 / TOKEN_S:.0f} tokens/s: each student drew {min(len(s.firsts) for s in students)}-"
          f"{max(len(s.firsts) for s in students)} of its token counts; from the teacher's server publishing a token "
          f"to a student's session drawing it: median {sorted(delays)[len(delays) // 2]:.3f} s, p95 {p95(delays):.3f} "
          f"s, max {max(delays):.3f} s ({len(delays)} deliveries; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}).")
    assert p95(delays) <= P95_S
    for _, proc, log in servers:
        assert proc.poll() is None and "Traceback" not in log.read_text()
