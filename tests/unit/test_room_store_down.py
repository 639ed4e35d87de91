"""The room store (a real redis-server) failing for one caller while others use it: a timeout in one thread must
not close a connection another thread is reading (CI once saw thirty students join during a pause of the store:
the pool was closed under the readers and their pages crashed with "I/O operation on closed file"), and the
failures a later call may not meet are told apart from the store's refusals (rooms_state.STORE_DOWN: a page
waits for the store instead of calling a room code wrong)."""
from __future__ import annotations

import threading
import time

import pytest

from inspector.session.rooms_redis import RedisBackend, RedisError
from inspector.session.rooms_state import STORE_DOWN
from tests.redis_server import hung_server, redis_process

pytestmark = pytest.mark.unit


def test_a_timeout_in_one_thread_leaves_another_threads_call_alone():
    with redis_process() as redis:
        backend = RedisBackend.from_url(redis.url, timeout=1.0)
        calls, outcome = [], {}

        def reader():                 # a call in flight when the other thread times out: BLPOP waits 0.6 s
            def f(r):
                calls.append(time.monotonic())
                return r.blpop(["llmi-test-a"], timeout=0.6)
            try:
                outcome["value"] = backend.call(f)
            except Exception as e:     # noqa: BLE001 -- the test reports what escaped
                outcome["error"] = e
        t0 = time.monotonic()
        slow = threading.Thread(target=lambda: pytest.raises(STORE_DOWN, backend.call,
                                                             lambda r: r.blpop(["llmi-test-b"], timeout=5)))
        slow.start()                   # its reply never comes within 1 s: it times out at t0 + 1
        time.sleep(0.5)
        t = threading.Thread(target=reader)
        t.start()                      # reading from t0 + 0.5 to t0 + 1.1 (Redis times BLPOP out to 0.1 s)
        t.join(5)
        slow.join(5)
        assert "error" not in outcome, outcome
        assert outcome["value"] is None and len(calls) == 1, (outcome, calls)   # one call, not retried
        assert time.monotonic() - t0 >= 1.0


def test_no_answer_and_no_connection_are_the_store_down_and_refusals_are_not():
    with hung_server() as (url, _):
        with pytest.raises(STORE_DOWN, match="did not answer within 0.5 s"):
            RedisBackend.from_url(url).get("k")
    with redis_process() as redis:
        backend = RedisBackend.from_url(redis.url)
        backend.call(lambda r: r.hset("h", "f", "v"))
        with pytest.raises(RedisError, match="WRONGTYPE") as refused:
            backend.get("h")                                  # an error reply: the store answered
        assert not isinstance(refused.value, STORE_DOWN)
        redis.stop()
        with pytest.raises(STORE_DOWN, match="cannot be reached"):
            backend.get("k")
