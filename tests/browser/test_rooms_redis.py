"""Rooms across processes: two app servers (`streamlit run app.py`, 127.0.0.1) share one real Redis server
(Debian's redis-server on a unix socket in a temporary folder, started and always stopped here). The teacher
uses one server, the ten students the other: the same lesson as tests/browser/test_rooms.py. Runs travel as
trace bytes through Redis; the students' server never generates; a publish with a forged token, sent to
Redis directly, is refused and changes nothing."""
from __future__ import annotations

import pytest

from inspector.session.rooms import RoomStore
from inspector.session.rooms_redis import RedisBackend
from inspector.session.rooms_state import Forbidden, View
from tests.browser.test_rooms import check_lesson, class_seated, lesson, redis_room_servers

pytestmark = [pytest.mark.browser, pytest.mark.alone]      # its delays, schedule or memory: by itself (tests/alone.py)


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory, tiny_model_dir):
    with redis_room_servers(tmp_path_factory.mktemp("rooms-redis"), tiny_model_dir) as (url, servers):
        yield url, *servers


@pytest.fixture
def seated(two_servers, browser):
    """The teacher on the first server, the students joining on the second (the lesson's opening, untimed)."""
    url, (a, _, _), (b, _, _) = two_servers
    with class_seated(browser, a, b) as seated:
        yield seated


def test_teacher_on_one_server_students_on_another(two_servers, seated, tiny_model):
    url, (a, proc_a, log_a), (b, proc_b, log_b) = two_servers
    r = lesson(seated, tiny_model.tokenizer)
    check_lesson(r, tiny_model.tokenizer)
    assert r["teacher_generations"] == 2 == r["teacher_generations_end"]     # the teacher's process: its runs
    assert r["student_generations"] == 0                                      # the students' process: none
    store = RoomStore(RedisBackend.from_url(url))
    before = store.state(r["code"])
    assert before is not None and before.run_id
    for forged in ["", "guess", "x" * 43]:
        with pytest.raises(Forbidden):
            store.publish(r["code"], forged, view=View(page="tokens"))
    assert store.state(r["code"]) == before
    for proc, log in ((proc_a, log_a), (proc_b, log_b)):
        assert proc.poll() is None and "Traceback" not in log.read_text()
