"""Servers the browser tier shares: started once per test session where no test needs a fresh one (a first
visitor, a restart, a count of the process's own generations, or other settings keep their own server)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import streamlit_server

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The app as `streamlit run app.py` serves it on the bundled model (no $LLM_INSPECTOR_MODEL): one process
    for tests/browser/test_browser.py, test_projector.py and test_projector_sampling.py, each in its own browser
    session. Modules that define their own `server` fixture (test_load_server, test_rooms) use theirs."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (scripts/setup.sh --test installs it)")
    pytest.importorskip("playwright")
    env = {k: v for k, v in os.environ.items() if k != "LLM_INSPECTOR_MODEL"}
    with streamlit_server(env, tmp_path_factory.mktemp("server") / "streamlit.log") as (url, _):
        yield url


@pytest.fixture(scope="session")
def room_servers(tmp_path_factory, tiny_model_dir):
    """One redis-server and two app processes sharing it (tests.browser.test_rooms.redis_room_servers), for the
    WebSocket room tests (test_room_latency, test_room_live_ws): their students only follow, the runs are made in
    the test process, and each test opens its own room. test_rooms_redis keeps its own pair: it counts the
    generations of each process."""
    from tests.browser.test_rooms import redis_room_servers
    with redis_room_servers(tmp_path_factory.mktemp("room-servers"), tiny_model_dir) as (url, servers):
        yield url, servers
