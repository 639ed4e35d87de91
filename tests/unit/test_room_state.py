"""Rooms (inspector.session.rooms): the same contract run against the in-process store and a real Redis server
(Debian's redis-server on a unix socket in a temporary folder, started and always stopped here; those
cases are skipped only where the binary is missing). Publish and follow, versions, a forged publish refused,
poll totals, and hostile values in the store or from a browser rejected with a message."""
from __future__ import annotations

import json
import socket
import threading

import pytest

from engine import RunSettings, SamplingParams
from engine.inspection.trace import from_bytes, to_bytes
from inspector.session.rooms import RoomStore, shared_store
from inspector.session.rooms_keys import RateLimiter, teacher_key_ok, teacher_key_state
from inspector.session.rooms_memory import MemoryBackend
from inspector.session.rooms_redis import RedisBackend, RedisError
from inspector.session.rooms_state import (
    ROOM_PAGES,
    Forbidden,
    NoRoom,
    RoomError,
    View,
    check_code,
)
from inspector.session.run import generations, inspect_run
from tests.redis_server import redis_server

pytestmark = pytest.mark.unit
@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(params=["memory", "redis"])
def backend(request):
    if request.param == "memory":
        return MemoryBackend()
    return RedisBackend.from_url(request.getfixturevalue("redis_url"))


@pytest.fixture
def store(backend):
    return RoomStore(backend, ttl_s=600)


def test_a_teacher_publishes_and_a_student_follows_by_version(store):
    code, token = store.create()
    assert check_code(code) == code and len(token) >= 40
    s0 = store.state(code)
    assert s0.version >= 1 and s0.run_id is None and s0.view == View()
    view = View(page="attention", step=3, layer=1, head=2, params=SamplingParams(temperature=0.7, top_p=0.9))
    s1 = store.publish(code, token, view=view)
    assert s1.version > s0.version and store.state(code) == s1 and store.state(code).view == view
    assert store.publish(code, token, view=view).version == s1.version          # nothing changed: same version
    s2 = store.publish(code, token, view=View(page="sampling", step=4))
    assert s2.version > s1.version and store.state(code.lower()).view.page == "sampling"   # a typed code
    assert store.state("ZZZZZZ") is None


def test_a_run_is_shared_as_trace_bytes_and_read_back_validated(store, tiny_model):
    code, token = store.create()
    run = inspect_run(tiny_model, RunSettings(prompt="Hello there", max_new_tokens=4))
    data = to_bytes(run)
    s = store.publish(code, token, run=data)
    assert s.run_id and store.run_bytes(code, s.run_id) == data
    back = from_bytes(store.run_bytes(code, s.run_id))
    assert back.result.token_ids == run.result.token_ids and back.result.text == run.result.text
    assert store.publish(code, token, run=data).version == s.version            # the same run again: no change
    run2 = inspect_run(tiny_model, RunSettings(prompt="Another one", max_new_tokens=3))
    s2 = store.publish(code, token, run=to_bytes(run2))
    assert s2.run_id != s.run_id and s2.prev_run_id == s.run_id
    assert store.run_bytes(code, s.run_id) == data                             # kept one publish longer
    s3 = store.publish(code, token, run=to_bytes(inspect_run(tiny_model, RunSettings(prompt="A third",
                                                                                     max_new_tokens=2))))
    assert store.run_bytes(code, s.run_id) is None and store.run_bytes(code, s2.run_id) is not None
    assert s3.prev_run_id == s2.run_id


def test_a_forged_publish_is_refused_and_changes_nothing(store):
    code, token = store.create()
    other_code, other_token = store.create()
    before = store.state(code)
    for forged in [None, "", "guess", token[:-1], token + "x", other_token, 12345, token.upper()]:
        with pytest.raises(Forbidden):
            store.publish(code, forged, view=View(page="tokens"))
        with pytest.raises(Forbidden):
            store.ask(code, forged, step=0)
        with pytest.raises(Forbidden):
            store.end(code, forged)
    assert store.state(code) == before
    new = store.take_over(code)                       # the teacher key holder's new token; the old one stops
    with pytest.raises(Forbidden):
        store.publish(code, token, view=View(page="tokens"))
    assert store.publish(code, new, view=View(page="tokens")).view.page == "tokens"
    store.end(code, new)
    assert store.state(code) is None
    with pytest.raises(NoRoom):
        store.publish(code, new, view=View())
    assert store.state(other_code) is not None


def test_poll_totals_equal_the_answers_sent_one_per_session(store):
    code, token = store.create()
    poll = store.ask(code, token, step=2, choices=[5, 6, 7])
    assert store.state(code).poll == poll and poll.choices == (5, 6, 7) and not poll.revealed
    answers = {f"{i:08x}": [5, 6, 7, 900][i % 4] for i in range(23)}
    results = []
    threads = [threading.Thread(target=lambda v=v, t=t: results.append(store.answer(code, poll.id, v, t)))
               for v, t in answers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results) and len(results) == len(answers)
    assert store.answer(code, poll.id, "00000000", 7) is False                 # a second answer: not counted
    want: dict[int, int] = {}
    for t in answers.values():
        want[t] = want.get(t, 0) + 1
    assert store.tally(code, poll.id) == want and sum(want.values()) == 23
    assert store.reveal(code, token).revealed and store.state(code).poll.revealed
    second = store.ask(code, token, step=3)
    assert second.id != poll.id and store.state(code).past_polls[-1].id == poll.id
    assert store.tally(code, poll.id) == want                                  # kept until the room ends
    with pytest.raises(RoomError):
        store.answer(code, poll.id, "abcdef01", 5)                             # that poll has closed
    store.close_poll(code, token)
    assert store.state(code).poll is None
    store.end(code, token)
    assert store.tally(code, poll.id) == {}


def test_a_voter_reads_back_the_answer_that_counts(store, backend):
    """A student's screen after a reload (a new session, the same browser) asks the store what this browser
    answered: the first answer, never a second one; nothing for a voter who has not answered; a value in the
    store that is not a token id (someone else wrote it) reads as no answer."""
    code, token = store.create()
    poll = store.ask(code, token, step=1, choices=[5, 6])
    assert store.my_answer(code, poll.id, "0000beef") is None
    assert store.answer(code, poll.id, "0000beef", 6) and not store.answer(code, poll.id, "0000beef", 5)
    assert store.my_answer(code, poll.id, "0000beef") == 6 and store.tally(code, poll.id) == {6: 1}
    assert store.my_answer(code, poll.id, "0000cafe") is None
    assert store.my_answer(code, poll.id, "not hex!") is None
    backend.hsetnx(store._k(code, "poll", poll.id), "0000f00d", b"x" * 100, 600)
    assert store.my_answer(code, poll.id, "0000f00d") is None
    second = store.ask(code, token, step=2)
    assert store.my_answer(code, second.id, "0000beef") is None                # one answer per poll


@pytest.mark.parametrize("bad", [
    {"voter": "not hex!", "tok": 5}, {"voter": "a" * 65, "tok": 5}, {"voter": "abc", "tok": -1},
    {"voter": "abc", "tok": 1 << 40}, {"voter": "abc", "tok": "5"}, {"voter": "abc", "tok": True},
    {"voter": 7, "tok": 5}])
def test_hostile_answers_are_refused(store, bad):
    code, token = store.create()
    poll = store.ask(code, token, step=0)
    with pytest.raises(RoomError):
        store.answer(code, poll.id, bad["voter"], bad["tok"])
    assert store.tally(code, poll.id) == {}


@pytest.mark.parametrize("code", ["", "abc", "ABCDEFG", "ABCDE0", "ABC DE", "../../x", "ÅBCDEF", None, 123456,
                                  "ABCDE\n"])
def test_malformed_codes_are_refused_before_the_store_is_asked(code):
    with pytest.raises(RoomError):
        check_code(code)
    store = RoomStore(MemoryBackend())
    if isinstance(code, str) and code.strip():
        with pytest.raises(RoomError):
            store.state(code)


HOSTILE_STATES = [
    b"not json", b"[" * 100_000, b"[]", json.dumps({"code": "OTHER1"}).encode(),
    {"version": -1}, {"version": "7"}, {"version": True}, {"run_id": "../../etc/passwd"}, {"run_id": 5},
    {"view": {"page": "../../app", "step": 0, "layer": 0, "head": None, "params": {}}},
    {"view": {"page": "secrets", "step": 0, "layer": 0, "head": None, "params": {}}},
    {"view": {"page": "attention", "step": -1, "layer": 0, "head": None, "params": {}}},
    {"view": {"page": "attention", "step": 0, "layer": 10 ** 9, "head": None, "params": {}}},
    {"view": {"page": "attention", "step": 0, "layer": 0, "head": 1.5, "params": {}}},
    {"view": {"page": "attention", "step": 0, "layer": 0, "head": None, "params": {"temperature": -1}}},
    {"view": {"page": "attention", "step": 0, "layer": 0, "head": None, "params": {"temperature": "hot"}}},
    {"view": {"page": "attention", "step": 0, "layer": 0, "head": None, "params": {"__class__": 1}}},
    {"view": {"page": "attention", "step": 0, "layer": 0, "head": None, "params": {"top_p": float("nan")}}},
    {"poll": {"id": 1, "step": 0, "choices": list(range(100))}}, {"poll": {"id": 0, "step": 0}},
    {"poll": {"id": 1, "step": 0, "choices": ["x"]}}, {"past_polls": [{"id": 1, "step": 0}] * 1000},
]


@pytest.mark.parametrize("hostile", HOSTILE_STATES, ids=range(len(HOSTILE_STATES)))
def test_a_hostile_state_in_the_store_is_rejected_with_a_message(store, hostile):
    code, token = store.create()
    good = json.loads(store.b.get(store._k(code, "state")))
    data = hostile if isinstance(hostile, bytes) else json.dumps({**good, **hostile}).encode()
    store.b.set(store._k(code, "state"), data, 60)
    with pytest.raises(RoomError):
        store.state(code)


def test_the_view_checks_every_field():
    assert [p for p in ROOM_PAGES if View.from_dict({**View().as_dict(), "page": p}).page != p] == []
    with pytest.raises(RoomError):
        View.from_dict({**View().as_dict(), "page": "Overview"})
    v = View(page="sampling", step=5, layer=2, head=None, params=SamplingParams(top_k=40, temperature=1.2))
    assert View.from_dict(json.loads(json.dumps(v.as_dict()))) == v


def test_the_teacher_key_is_needed_and_compared_whole():
    assert "LLM_INSPECTOR_TEACHER_KEY" in teacher_key_state({})
    assert "at least" in teacher_key_state({"LLM_INSPECTOR_TEACHER_KEY": "short"})
    env = {"LLM_INSPECTOR_TEACHER_KEY": "correct horse battery"}
    assert teacher_key_state(env) is None
    assert teacher_key_ok("correct horse battery", env)
    for wrong in ["", "correct", "correct horse battery ", "CORRECT HORSE BATTERY", None, 5, "x" * 5000]:
        assert not teacher_key_ok(wrong, env)
    assert not teacher_key_ok("", {})


def test_failed_joins_are_rate_limited_per_browser_and_in_all():
    now = [0.0]
    lim = RateLimiter(limit=3, total=5, window_s=60, clock=lambda: now[0])
    assert [lim.allow("a") for _ in range(4)] == [True, True, True, False]
    assert [lim.allow("b") for _ in range(3)] == [True, True, False]            # everyone together: 5
    now[0] = 61
    assert lim.allow("a") and lim.allow("b")


def test_the_memory_store_forgets_rooms_after_their_time_to_live():
    now = [0.0]
    store = RoomStore(MemoryBackend(clock=lambda: now[0]), ttl_s=100)
    code, token = store.create()
    now[0] = 90
    store.publish(code, token, view=View(page="tokens"))      # a publish keeps the room alive
    now[0] = 180
    assert store.state(code).view.page == "tokens"
    now[0] = 300
    assert store.state(code) is None


def test_the_store_is_chosen_by_the_environment(redis_url):
    assert isinstance(shared_store({}).b, MemoryBackend)
    assert shared_store({}) is shared_store({"LLM_INSPECTOR_ROOMS": "memory"})
    assert isinstance(shared_store({"LLM_INSPECTOR_ROOMS": redis_url}).b, RedisBackend)
    for bad in ["http://x", "redis://host:notaport", "unix://"]:
        with pytest.raises(RoomError):
            shared_store({"LLM_INSPECTOR_ROOMS": bad})
    with pytest.raises(RoomError):
        shared_store({"LLM_INSPECTOR_ROOM_TTL_S": "soon"})


def test_an_unreachable_redis_is_one_clear_error(tmp_path):
    store = RoomStore(RedisBackend(str(tmp_path / "nothing.sock"), timeout=0.5))
    with pytest.raises(RedisError, match="cannot be reached"):
        store.create()
    with socket.socket() as s:                                      # a TCP port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RedisError):
        RoomStore(RedisBackend.from_url(f"redis://127.0.0.1:{port}", timeout=0.5)).state("ABCDEF")


def test_every_read_is_bounded_by_the_reader_not_by_what_the_store_holds(store):
    """A store someone else can write to holds a state, a live document and a run over their bounds, and a poll of
    huge answers: each is refused (or skipped) having read at most its bound plus one byte."""
    from inspector.session.rooms_live import MAX_LIVE_BYTES
    from inspector.session.rooms_redis import DEFAULT_LIMIT
    code, token = store.create()
    poll = store.ask(code, token, step=0)
    read: list[int] = []
    b = store.b
    real_get = b.get

    def get(key, *a, **k):
        v = real_get(key, *a, **k)
        read.append(0 if v is None else len(v))
        return v
    b.get = get
    huge = b"x" * (DEFAULT_LIMIT * 3)
    b.set(store._k(code, "live"), b'{"seq": 1, "text": "' + huge + b'"}', 60)
    with pytest.raises(RoomError):
        store.live(code)
    assert max(read) <= MAX_LIVE_BYTES + 1
    b.set(store._k(code, "run", "ab" * 16), b"y" * (DEFAULT_LIMIT * 3), 60)
    read.clear()
    assert len(store.run_bytes(code, "ab" * 16)) == DEFAULT_LIMIT * 3        # a run: up to MAX_RUN_BYTES
    b.set(store._k(code, "state"), b'{"code": "' + huge + b'"}', 60)
    read.clear()
    with pytest.raises(RoomError, match="over"):
        store.state(code)
    assert read == [DEFAULT_LIMIT + 1]
    b.get = real_get
    key = store._k(code, "poll", poll.id)
    for i in range(5):
        b.hsetnx(key, f"{i:08x}", b"7" if i % 2 else b"9" * 100_000, 60)
    assert store.tally(code, poll.id) == {7: 2}                              # the huge answers skipped, unread
    assert b.hvals(key, 2, 9) == [b"7"] or len(b.hvals(key, 2, 9)) <= 2


def test_the_generation_counter_counts_each_run_once(tiny_model):
    before = generations()
    inspect_run(tiny_model, RunSettings(prompt="count me", max_new_tokens=2))
    assert generations() == before + 1
