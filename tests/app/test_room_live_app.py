"""Issue 23 in the app (AppTest of app.py): a following student's screen shows the teacher's run as it
generates (item 1), is told that the room is reconnecting when its store (a real redis-server) stops or
restarts empty and follows again once the teacher's screen has re-opened the room under the same code
(item 2), and its sidebar shows the teacher's prompt and settings, not the student's own (item 3)."""
from __future__ import annotations

import signal
import time
from contextlib import contextmanager

import pytest

from engine import RunSettings, SamplingParams
from engine.inspection.trace import to_bytes
from inspector.session.memo import run_key
from inspector.session.rooms import shared_store
from inspector.session.rooms_live import Live, LiveToken
from inspector.session.rooms_state import View
from inspector.session.run import inspect_run
from inspector.session.state import RoomSeat
from inspector.ui.state import session_of
from tests.app.test_app_pages_b import fresh_app
from tests.redis_server import redis_process

pytestmark = pytest.mark.app
PROMPT = "Tell me about lighthouses."


@pytest.fixture
def env(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.delenv("LLM_INSPECTOR_ROOMS", raising=False)
    return str(tiny_model_dir)


def teacher_run(model):
    return inspect_run(model, RunSettings(prompt=PROMPT, chat=False, max_new_tokens=5, seed=7,
                                          params=SamplingParams(temperature=0.7, top_p=0.9)))


def join(app_file, source, code):
    at = fresh_app(app_file, source)
    at.query_params["room"] = code
    at.run()
    assert not at.exception, at.exception
    return at


def warnings(at) -> str:
    return " ".join(w.value for w in at.warning)


def test_a_following_students_sidebar_shows_the_teachers_prompt_and_settings(env, app_file, tiny_model):
    store = shared_store()
    code, token = store.create()
    store.publish(code, token, run=to_bytes(teacher_run(tiny_model)), view=View())
    at = fresh_app(app_file, env)
    at.run()
    at.sidebar.text_area(key="sb_prompt").set_value("my own question").run()
    at.query_params["room"] = code
    at.run()
    assert session_of(at.session_state).room.following
    assert "Prompt (the teacher's run)" in [m.value.strip("*") for m in at.sidebar.markdown]
    assert PROMPT in [c.value for c in at.sidebar.code]               # read-only: a code box, not a widget
    assert not [t for t in at.sidebar.text_area if t.key == "sb_prompt"]
    said = " ".join(c.value for c in at.sidebar.caption).replace("\\", "")      # Markdown escapes
    assert "T=0.7 top-p=0.9" in said and "seed 7" in said and "up to 5 new tokens" in said
    at.button(key="room_detach").click().run()                     # explore on my own: my prompt is back
    assert at.sidebar.text_area(key="sb_prompt").value == "my own question"


def test_a_following_student_sees_the_teachers_run_grow(env, app_file, tiny_model):
    store = shared_store()
    code, token = store.create()
    store.publish(code, token, run=to_bytes(teacher_run(tiny_model)), view=View())
    at = join(app_file, env, code)
    live = store.start_live(code, token, "Write a poem", 8)
    at.run()
    assert any("starting" in m.value or "waiting for a slot" in m.value for m in at.markdown)
    store.publish_live(code, token, Live(live.seq, "Write a poem", 8, "prefill", 0.5))
    at.run()
    assert [p.proto.text for p in at.get("progress")] == ["reading the prompt: 50%"]
    texts = []
    for n, piece in enumerate(["Roses", " are", " red"], 1):
        texts.append((texts[-1] if texts else "") + piece)
        store.publish_live(code, token, Live(live.seq, "Write a poem", 8, "decode", 1.0, n, texts[-1],
                                             LiveToken(piece, 0.25, ((piece, 0.25), (" blue", 0.2)))))
        at.run()
        assert not at.exception, at.exception
        assert [p.proto.text for p in at.get("progress")] == [f"token {n} of at most 8"]
        codes = [c.value for c in at.code]
        assert codes[0] == texts[-1] and not set(texts[:-1]) & set(codes)   # above the page, growing
        assert any(f"Newest token {piece!r}, chosen with probability 0.25" in t.value for t in at.text)
    assert any(t.value == "Prompt: Write a poem" for t in at.text)
    run = inspect_run(tiny_model, RunSettings(prompt="Write a poem", chat=False, max_new_tokens=3))
    store.publish(code, token, run=to_bytes(run))                        # the full run replaces the live one
    at.run()
    assert not at.get("progress") and session_of(at.session_state).run.settings.prompt == "Write a poem"


def test_during_the_rooms_first_run_a_students_sidebar_shows_it_generating(env, app_file):
    """Issue 33, item 5: while the teacher's first run in a room streams, the student's sidebar said "The teacher has
    not run anything in this room yet." It shows that run's prompt and says it is generating."""
    store = shared_store()
    code, token = store.create()
    at = join(app_file, env, code)
    nothing = "The teacher has not run anything in this room yet."
    assert any(c.value == nothing for c in at.sidebar.caption)          # before the run: true
    live = store.start_live(code, token, "Write a poem", 8)
    store.publish_live(code, token, Live(live.seq, "Write a poem", 8, "decode", 1.0, 1, "Roses",
                                         LiveToken("Roses", 0.25, (("Roses", 0.25),))))
    at.run()
    assert not at.exception, at.exception
    said = [c.value for c in at.sidebar.caption]
    assert nothing not in said and any("The teacher's run is generating" in c for c in said), said
    assert "Prompt (the teacher's run, generating)" in [m.value.strip("*") for m in at.sidebar.markdown]
    assert "Write a poem" in [c.value for c in at.sidebar.code] and not [t for t in at.sidebar.text_area]


@contextmanager
def room_on_redis(monkeypatch):
    """A real redis-server as the rooms' store (always stopped), and a room in it: (server, store, code, token)."""
    with redis_process() as redis:
        monkeypatch.setenv("LLM_INSPECTOR_ROOMS", redis.url)
        store = shared_store()
        yield (redis, store, *store.create())


def test_students_are_told_the_room_is_reconnecting_and_follow_again_after_a_restart(
        env, app_file, tiny_model, monkeypatch):
    with room_on_redis(monkeypatch) as (redis, store, code, token):
        run = teacher_run(tiny_model)
        view = View("attention", layer=1)
        state = store.publish(code, token, run=to_bytes(run), view=view)
        teacher = fresh_app(app_file, env)
        teacher.session_state["att_layer"] = 1
        session_of(teacher.session_state).runs = [run]
        session_of(teacher.session_state).run = run
        session_of(teacher.session_state).room = RoomSeat("teacher", code, token=token, page="attention", view=view,
                                                          run_key=run_key(run), run_id=state.run_id, published=True)
        student = join(app_file, env, code)
        assert session_of(student.session_state).room.following and "reconnecting" not in warnings(student)

        redis.stop()                                                      # the store does not answer
        student.run()
        assert "The room is reconnecting" in warnings(student) and "does not answer" in warnings(student)
        assert session_of(student.session_state).room.following and not session_of(student.session_state).room.ended

        redis.start()                                                     # back, and empty
        student.run()
        assert "restarted and lost it" in warnings(student)
        teacher.switch_page("views/attention.py").run()                # the teacher's screen shows layer 1
        assert not teacher.exception, teacher.exception
        assert any("re-opened it under the same code" in i.value for i in teacher.info)
        back = store.state(code)
        assert back is not None and back.run_id == state.run_id and back.view == view

        student.run()
        assert "reconnecting" not in warnings(student) and session_of(student.session_state).room.following
        assert any("following the teacher: Attention · layer 1" in m.value.replace("\\", "")
                   for m in student.markdown)


def test_a_student_who_opens_the_link_while_the_store_pauses_joins_when_it_answers(
        env, app_file, tiny_model, monkeypatch):
    with room_on_redis(monkeypatch) as (redis, store, code, token):
        store.publish(code, token, run=to_bytes(teacher_run(tiny_model)), view=View())
        redis.proc.send_signal(signal.SIGSTOP)                            # paused: no answer within 0.5 s
        try:
            student = join(app_file, env, code)
        finally:
            redis.proc.send_signal(signal.SIGCONT)
        said = " ".join(e.value for e in student.sidebar.error).replace("\\", "")
        assert f"Joining room {code}: the room's store does not answer" in said, said
        assert session_of(student.session_state).room is None
        time.sleep(2.1)                                                   # the store's cool-down after a timeout
        student.query_params.pop("room")          # the watcher's rerun, asked during the session's first script
        student.run()                             # run, carries no query string (Streamlit saves it at the run's end)
        assert not student.exception, student.exception
        assert session_of(student.session_state).room.following
        assert any(f"Room {code}** · following the teacher" in m.value.replace("\\", "") for m in student.markdown)
        assert not student.sidebar.error
