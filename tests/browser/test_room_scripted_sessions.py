"""Issue 31, item 7: a server no script can fill. The real server on 127.0.0.1 with Redis rooms and 64 MiB a
session; a room shows a large run (about 23 MiB of trace bytes). A script opens sessions that follow the room
over Streamlit's WebSocket, as the security review did: 20 without any cookie and 30 that each invent a new
browser cookie. Sessions without a cookie count as one browser (8 admitted), the server holds at most
LLM_INSPECTOR_MAX_SESSIONS of them all (24 here), everyone else is told so and holds nothing, the followers
share one parsed copy of the run, and the server's memory stays within the bound docs/CLASSROOM.md states for
any client: what it held before + admitted sessions × MAX_SESSION_MB. (Before: 20 cookie-less and 10
fresh-cookie sessions grew the server 830–966 MB, each holding its own parsed copy of the run.)"""
from __future__ import annotations

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
from tests.browser.test_rooms import SERVER_ARGS, room_server, server_env
from tests.redis_server import redis_server

pytestmark = pytest.mark.browser
BUDGET_MB, MAX_SESSIONS, PER_BROWSER = 64, 24, 8
COOKIELESS, INVENTED = 20, 30
NEW_TOKENS = 120
FOLLOWING = b"following the teacher"
REFUSED = (b"already hold", b"already has", b"already holds")


class Script:
    """One scripted session: a WebSocket that asks for the app at /?room=CODE (with an invented cookie, or none)
    and keeps what the server pushes until it has drawn the room or been refused."""

    def __init__(self, base: str, code: str, cookie: str | None) -> None:
        from streamlit.proto.BackMsg_pb2 import BackMsg
        from websockets.sync.client import connect
        headers = {"Cookie": f"_streamlit_xsrf={cookie}"} if cookie else {}
        self.ws = connect(base.replace("http://", "ws://") + "/_stcore/stream", subprotocols=["streamlit"],
                          proxy=None, max_size=256 << 20, open_timeout=60, additional_headers=headers)
        msg = BackMsg()
        msg.rerun_script.query_string = f"room={code}"
        self.ws.send(msg.SerializeToString())
        self.outcome: str | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for data in self.ws:
                if self.outcome is None and any(r in data for r in REFUSED):
                    self.outcome = "refused"
                elif self.outcome is None and FOLLOWING in data:
                    self.outcome = "following"
                if self.outcome:
                    self.done.set()
        except Exception:            # closed at the end of the test
            self.done.set()

    def close(self) -> None:
        self.ws.close()
        self.thread.join(5)


def test_scripted_sessions_cannot_grow_the_server_past_its_stated_bound(tmp_path, tiny_model, tiny_model_dir):
    run = inspect_run(tiny_model, RunSettings(prompt="Tell me a long story about a lighthouse keeper.", chat=False,
                                              max_new_tokens=NEW_TOKENS, ignore_eos=True))
    data = to_bytes(run)
    assert len(data) > 16 << 20, len(data)                 # a large run, as in the review (23 MiB)
    with redis_server() as url:
        env = {**server_env(tiny_model_dir, LLM_INSPECTOR_ROOMS=url), "LLM_INSPECTOR_MAX_NEW_TOKENS": str(NEW_TOKENS),
               "LLM_INSPECTOR_MAX_SESSION_MB": str(BUDGET_MB), "LLM_INSPECTOR_MAX_SESSIONS": str(MAX_SESSIONS),
               "LLM_INSPECTOR_MAX_RUNS_KEPT": "1"}
        with room_server(env, tmp_path / "server.log", *SERVER_ARGS) as (base, proc):
            store = RoomStore(RedisBackend.from_url(url, timeout=10))
            code, token = store.create()
            store.publish(code, token, run=data, view=View())
            warm = Script(base, code, "warm-up-browser")    # loads the model and parses the run once
            assert warm.done.wait(180) and warm.outcome == "following", warm.outcome
            time.sleep(2)
            server = psutil.Process(proc.pid)
            rss0 = server.memory_info().rss
            scripts = []
            try:
                for k in range(COOKIELESS + INVENTED):
                    cookie = None if k < COOKIELESS else secrets.token_hex(16)
                    scripts.append(Script(base, code, cookie))
                deadline = time.monotonic() + 300
                peak = rss0
                while time.monotonic() < deadline and not all(s.done.is_set() for s in scripts):
                    peak = max(peak, server.memory_info().rss)
                    time.sleep(0.2)
                for _ in range(15):                        # every session's page has ended
                    peak = max(peak, server.memory_info().rss)
                    time.sleep(0.2)
                outcomes = [s.outcome for s in scripts]
            finally:
                for s in scripts:
                    s.close()
                warm.close()
    cookieless, invented = outcomes[:COOKIELESS], outcomes[COOKIELESS:]
    admitted = outcomes.count("following") + 1                                 # the warm-up session too
    bound = rss0 + admitted * BUDGET_MB * 2**20
    print(f"\nscripted sessions: {COOKIELESS} without a cookie ({cookieless.count('following')} admitted), "
          f"{INVENTED} with invented cookies ({invented.count('following')} admitted); a {len(data) / 2**20:.1f} MiB "
          f"run; server RSS {rss0 / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB (+{(peak - rss0) / 2**20:.0f} "
          f"MiB for {admitted - 1} more sessions); bound {bound / 2**20:.0f} MiB")
    assert None not in outcomes, outcomes
    assert cookieless.count("following") == PER_BROWSER - 0                    # one browser's share, no more
    assert admitted == MAX_SESSIONS                                            # the server's cap, whoever asks
    assert peak <= bound
    assert peak - rss0 < (admitted - 1) * len(data)                            # not a parsed copy per follower
