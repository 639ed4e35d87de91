"""What following a live run costs the teacher, with the servers a teacher starts (issue 33, item 5):
`scripts/serve.sh` as docs/CLASSROOM.md says, on the bundled model, nothing turned off (Streamlit's garbage
collection after every script run stays on). The teacher (Chromium) starts a room and runs a 64-token prompt
twice: alone, then with FOLLOWERS students following it live (one of them a Chromium tab, the others
WebSocket clients speaking Streamlit's protocol, as in test_room_latency). Two setups:

- one process: the teacher and the students on one server (rooms in process, the default);
- two processes: the teacher on one server, the students on another, one real redis-server between them.

Printed: the teacher's run time (the Overview's "Run (with inspection)") with 0 and with FOLLOWERS followers,
and across processes how many tokens (and seconds) each student was behind the teacher's server (the live
document in Redis, read every 20 ms) while the run streamed. Asserted: the run with followers takes at most RATIO
times the run alone (the defect: 20x); every student's screen drew the run live, a growing text (at least two
counts before the last token, the first of them before the teacher's server was half-way: the defect across
processes was a screen at "token 1" until the whole run arrived) and then the last token; the Chromium student's
sidebar never says that the teacher has run nothing while the run streams (it is the room's first run), and
names the teacher's prompt. How far behind a student is, in tokens, is a figure of the machine, not a bound: it
grows with the teacher's decode speed (a faster teacher is more tokens ahead in the same seconds) and with the
start of the run (every following screen reruns whole once to show the live panel); it is printed, and
LLM_INSPECTOR_FOLLOW_BEHIND (tokens) makes it a bound on a machine whose figures are known. Each live panel
reruns at most every followers / 20 s (inspector.ui.room_push.LIVE_RERUNS_S): with ten followers 0.5 s."""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from inspector.session.rooms import RoomStore
from inspector.session.rooms_redis import RedisBackend
from tests.browser.room_tabs import KEY, browsers_behind_servers, idle, open_tab, start_room, wait_text
from tests.browser.test_room_latency import Student
from tests.helpers import free_port, open_generation_settings, server_process
from tests.redis_server import redis_server

pytestmark = [pytest.mark.browser, pytest.mark.alone]      # its delays, schedule or memory: by itself (tests/alone.py)
ROOT = Path(__file__).resolve().parents[2]
FOLLOWERS = int(os.environ.get("LLM_INSPECTOR_FOLLOWERS", "10"))
NEW = 64
# Run time with followers / alone, at most. Measured on the 2-core test machine at load average 11-13: 1.75x and
# 4.0x on one process, 1.24x and 1.33x on two; before the freeze and the rerun budget 20x (one process) and students
# 64 tokens behind (two). The bound is what this shared machine holds with a margin (docs/CLASSROOM.md's table).
RATIO = float(os.environ.get("LLM_INSPECTOR_FOLLOW_RATIO", "6"))
# Tokens a student may trail the teacher's server: no bound unless set. Measured: 20-22 at load average 10-13 (a
# slow teacher), 26-30 on CI's otherwise idle machine (a fast one, 2.2 s behind at 14 tokens a second).
BEHIND = os.environ.get("LLM_INSPECTOR_FOLLOW_BEHIND")
PROMPT = "Write a long story about a lighthouse keeper and a storm."
NOTHING_YET = "The teacher has not run anything in this room yet."
COUNT = re.compile(rb"token (\d+) of at most %d" % NEW)


class Follower(Student):
    """A WebSocket student recording when each "token k of at most 64" first reached its session."""

    def __init__(self, base: str, code: str) -> None:
        self.firsts: dict[int, float] = {}
        self.joined = False                    # its session drew the room's line (before any expect())
        super().__init__(base, code)

    def _read(self) -> None:
        try:
            for data in self.ws:
                now = time.monotonic()
                with self.cond:
                    self.messages += 1
                    if not self.joined and b"following the teacher" in data:
                        self.joined = True
                        self.cond.notify_all()
                    for m in COUNT.finditer(data):
                        self.firsts.setdefault(int(m.group(1)), now)
                    if self.firsts and b"Generated text" in data:      # the whole run replaced the live view
                        self.firsts.setdefault(NEW, now)
                    if self.want is not None and self.seen is None and self.want in data:
                        self.seen = now
                        self.cond.notify_all()
        except Exception:            # the connection closed at the end of the test
            pass


@contextmanager
def serve(log: Path, **env):
    """`bash scripts/serve.sh` on a free port, the bundled model, a teacher key; (url, process)."""
    port = free_port()
    e = {k: v for k, v in os.environ.items() if k not in ("LLM_INSPECTOR_MODEL", "LLM_INSPECTOR_ROOMS")}
    e.update(LLM_INSPECTOR_PORT=str(port), PYTHON=sys.executable, LLM_INSPECTOR_TEACHER_KEY=KEY,
             LLM_INSPECTOR_MAX_NEW_TOKENS=str(NEW), LLM_INSPECTOR_MODEL_ROOTS="", LLM_INSPECTOR_HUB_CACHE="off", **env)
    with server_process(["bash", "scripts/serve.sh", "--server.fileWatcherType", "none"], ROOT, e, log, port) as s:
        yield s


def press_run(teacher) -> str | None:
    """Press Run and wait for its Stop; the Overview's run time shown before (to tell the new one from it)."""
    side = teacher.locator('[data-testid="stSidebar"]')
    metric = teacher.locator('[data-testid="stMetric"]').filter(has_text="Run (with inspection)")
    before = metric.inner_text() if metric.count() else None
    side.get_by_role("button", name="Run", exact=True).click()
    side.get_by_role("button", name="Stop", exact=True).wait_for(state="visible", timeout=120_000)
    return before


def run_time(teacher, before: str | None) -> float:
    """When the run has ended: the Overview's "Run (with inspection)", in seconds."""
    side = teacher.locator('[data-testid="stSidebar"]')
    side.get_by_role("button", name="Stop", exact=True).wait_for(state="detached", timeout=600_000)
    metric = teacher.locator('[data-testid="stMetric"]').filter(has_text="Run (with inspection)")
    end = time.monotonic() + 120
    while (not metric.count() or metric.inner_text() == before) and time.monotonic() < end:
        teacher.wait_for_timeout(200)
    idle(teacher)
    return float(re.search(r"([\d.]+) s", metric.inner_text()).group(1))


def set_up_teacher(browser, url: str):
    """A warm-up run in a tab of its own (the first run of a server prepares the native decode step), then the
    teacher's tab: a room, 64 new tokens, the prompt typed. (teacher context, teacher page, room code)"""
    wctx, warm = open_tab(browser, url)
    ready_run = warm.locator('[data-testid="stSidebar"]').get_by_role("button", name="Run", exact=True)
    ready_run.wait_for(timeout=300_000)
    idle(warm)
    run_time(warm, press_run(warm))
    wctx.close()
    tctx, teacher = open_tab(browser, url, viewport=(1280, 860))
    code = start_room(teacher)
    idle(teacher)
    open_generation_settings(teacher)
    box = teacher.get_by_label("Max new tokens", exact=True)
    box.fill(str(NEW))
    box.press("Enter")
    idle(teacher)
    prompt = teacher.get_by_role("textbox", name="Prompt", exact=True)
    prompt.fill(PROMPT)
    prompt.press("Control+Enter")
    idle(teacher)
    return tctx, teacher, code


def cpu(procs) -> float:
    """CPU seconds the app servers have used so far (every thread)."""
    return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)


@contextmanager
def class_seated(browser, teacher_url: str, student_url: str):
    """The lesson's opening, which it does not measure (the test's setup, beside the other workers' tests):
    set_up_teacher's warm-up run and room, one Chromium student and FOLLOWERS - 1 WebSocket students joined. Yields
    {"teacher", "code", "chromium", "students"}: "students" holds (close, what) pairs that leave() empties;
    whatever is still open is closed afterwards."""
    students: list = []
    tctx = None
    try:
        tctx, teacher, code = set_up_teacher(browser, teacher_url)
        sctx, chromium = open_tab(browser, f"{student_url}/?room={code}")
        students.append(sctx)
        wait_text(chromium, f"Room {code} · following the teacher")
        idle(chromium)
        assert NOTHING_YET in chromium.locator('[data-testid="stSidebar"]').inner_text()   # the room has no run yet
        followers = [Follower(student_url, code) for _ in range(FOLLOWERS - 1)]
        students += followers
        browsers_behind_servers()
        end = time.monotonic() + 300
        for s in followers:
            with s.cond:
                while not s.joined and time.monotonic() < end:
                    s.cond.wait(0.1)
        missing = [k for k, s in enumerate(followers) if not s.joined]
        assert not missing, f"students {missing} never joined the room"
        yield {"teacher": teacher, "code": code, "chromium": chromium, "followers": followers, "students": students}
    finally:
        leave(students)
        if tctx is not None:
            tctx.close()


def leave(students: list) -> None:
    """The students close their tabs and connections (once: the list is emptied)."""
    while students:
        students.pop().close()


def lesson(seated: dict, redis_url: str | None, procs) -> dict:
    teacher, code, chromium, followers = (seated[k] for k in ("teacher", "code", "chromium", "followers"))
    out: dict = {}
    timeline: list[tuple[float, int]] = []
    halt = threading.Event()
    try:
        time.sleep(1.0)
        reader = threading.Thread(target=read_live, args=(redis_url, code, timeline, halt), daemon=True)
        if redis_url:
            reader.start()
        c0, m0 = cpu(procs), sum(s.messages for s in followers)
        before = press_run(teacher)                   # the room's first run, FOLLOWERS students following it
        out["sidebar"], out["chromium_counts"] = follow_in_chromium(chromium)
        out["followed"] = run_time(teacher, before)
        out["cpu_followed"], out["messages"] = cpu(procs) - c0, sum(s.messages for s in followers) - m0
        halt.set()
        time.sleep(1.5)                               # the end of the run reaches every screen
    finally:
        halt.set()
        leave(seated["students"])
    out["counts"] = [sorted(s.firsts) for s in followers]
    out["behind"], out["behind_s"] = behind(timeline, followers) if redis_url else (None, None)
    time.sleep(3)
    c0 = cpu(procs)
    out["alone"] = run_time(teacher, press_run(teacher))      # the same prompt and seed, nobody following
    out["cpu_alone"] = cpu(procs) - c0
    return out


def follow_in_chromium(chromium) -> tuple[list[str], list[int]]:
    """While the teacher's run streams: the Chromium student's sidebar texts and the live token counts drawn."""
    side = chromium.locator('[data-testid="stSidebar"]')
    main = chromium.locator('[data-testid="stMain"]')
    texts, counts, end = [], [], time.monotonic() + 600
    while time.monotonic() < end:
        body = main.inner_text()
        if "The teacher's run, live" in body:
            texts.append(side.inner_text())       # one read: the prompt and its label, as drawn together
            counts += [int(x) for x in re.findall(r"token (\d+) of at most %d" % NEW, body)]
        elif texts and "Generated text" in body:
            break
        chromium.wait_for_timeout(100)
    return texts, counts


def read_live(url: str, code: str, timeline: list, halt: threading.Event) -> None:
    """The teacher's server's live count over time, read from Redis every 20 ms."""
    store = RoomStore(RedisBackend.from_url(url, timeout=5))
    while not halt.is_set():
        _, doc = store.live(code)
        if doc is not None:
            timeline.append((time.monotonic(), doc.tokens))
        time.sleep(0.02)


def behind(timeline: list[tuple[float, int]], followers: list[Follower]) -> tuple[list[int], list[float]]:
    """Per student: the most tokens it trailed the teacher's server by at any moment of the run, and the longest
    it showed a count the server had gone past, in seconds (from the moment the server published the next token
    to the moment the student drew one at least as far)."""
    tokens, seconds = [], []
    for s in followers:
        drawn = sorted(s.firsts.items(), key=lambda kv: kv[1])
        most, longest = 0, 0.0
        for t, published in timeline:
            have = max([k for k, at in drawn if at <= t], default=0)
            most = max(most, published - have)
            if published > have:
                since = next(at for at, n in timeline if n > have)
                longest = max(longest, t - since)
        tokens.append(most)
        seconds.append(round(longest, 2))
    return tokens, seconds


def check(r: dict, setup: str) -> None:
    ratio = r["followed"] / r["alone"]
    print(f"\n{setup}: the teacher's {NEW}-token run took {r['alone']:.2f} s alone and {r['followed']:.2f} s with "
          f"{FOLLOWERS} followers ({ratio:.2f}x); " + ("" if r["behind"] is None else
          f"students at most {max(r['behind'])} tokens behind the teacher's server (per student: {r['behind']}), "
          f"at most {max(r['behind_s']):.2f} s (per student: {r['behind_s']}); ")
          + f"the servers used {r['cpu_alone']:.1f} s of CPU for the run alone, {r['cpu_followed']:.1f} s followed "
          f"({r['messages']} messages to the WebSocket followers); load average {os.getloadavg()[0]:.1f} "
          f"({os.cpu_count()} CPUs).")
    assert r["sidebar"], "the Chromium student never showed the live run"
    assert not [t for t in r["sidebar"] if NOTHING_YET in t], "the sidebar said the teacher had run nothing"
    assert all(PROMPT in t for t in r["sidebar"]), r["sidebar"][0]
    assert r["chromium_counts"], "the Chromium student never drew the live run's token count"   # (its tab runs
    # niced under the servers: how far it grows in a 3 s run depends on the machine; the WebSocket students' counts do)
    for k, seen in enumerate(r["counts"]):
        live = [c for c in seen if c < NEW]         # drawn by the live panel while the run streamed
        assert len(live) >= 2 and live[0] < NEW // 2 and seen[-1] == NEW, \
            f"student {k} drew token counts {seen}: not the run growing live"
    if r["behind"] is not None and BEHIND is not None:
        assert max(r["behind"]) <= int(BEHIND), r["behind"]
    assert ratio <= RATIO, f"{FOLLOWERS} followers made the teacher's run {ratio:.2f} times slower"


@pytest.fixture
def one_process(browser, tmp_path):
    """One server (rooms in process): the teacher and the students on it, seated."""
    with serve(tmp_path / "a.log") as (url, proc), class_seated(browser, url, url) as seated:
        yield seated, None, [(proc, tmp_path / "a.log")]


@pytest.fixture
def two_processes(browser, tmp_path):
    """Two servers sharing one redis-server: the teacher on the first, the students on the second, seated."""
    with redis_server() as rurl, serve(tmp_path / "a.log", LLM_INSPECTOR_ROOMS=rurl) as (a, pa), \
            serve(tmp_path / "b.log", LLM_INSPECTOR_ROOMS=rurl) as (b, pb), class_seated(browser, a, b) as seated:
        yield seated, rurl, [(pa, tmp_path / "a.log"), (pb, tmp_path / "b.log")]


def followed_and_checked(setup, label: str) -> None:
    """The lesson in a seated class (one_process or two_processes), its servers alive and without a traceback
    afterwards, then check()."""
    seated, rurl, servers = setup
    r = lesson(seated, rurl, [p for p, _ in servers])
    for p, log in servers:
        assert p.poll() is None and "Traceback" not in log.read_text()
    check(r, label)


def test_followers_cost_the_teacher_little_on_one_process(one_process):
    followed_and_checked(one_process, "one process")


def test_followers_on_another_process_keep_up(two_processes):
    followed_and_checked(two_processes, "two processes, one Redis")
