"""Issue 31, item 7: no script can fill the server. Sessions without a browser cookie are one client together
(not a new browser each), and the server holds at most LLM_INSPECTOR_MAX_SESSIONS sessions whoever opens them,
so its memory is bounded for any client."""
from __future__ import annotations

import gc

import pytest

from inspector.session.clients import COOKIELESS, ClientSessions, SessionToken
from inspector.session.limits import Limits

pytestmark = pytest.mark.unit


def test_sessions_without_a_cookie_share_one_browsers_share():
    reg = ClientSessions()
    scripted = [SessionToken() for _ in range(20)]
    answers = [reg.admit(COOKIELESS, t, 8) for t in scripted]
    assert answers[:8] == [None] * 8 and all(a is not None for a in answers[8:])
    assert answers[8].startswith("Connections without a browser cookie (scripts) already hold 8 sessions")
    assert reg.live(COOKIELESS) == 8 and reg.total() == 8
    assert reg.admit("browser:student", SessionToken(), 8) is None           # a real browser still gets in


def test_the_server_holds_at_most_its_total_of_sessions_whoever_opens_them():
    reg = ClientSessions()
    keep = []
    refused = 0
    for i in range(60):                                                     # a script inventing a browser each time
        t = SessionToken()
        keep.append(t)
        refused += reg.admit(f"browser:invented-{i}", t, 8, total=25) is not None
    assert reg.total() == 25 and refused == 35
    msg = reg.admit("browser:late-student", SessionToken(), 8, total=25)
    assert msg.startswith("This server already holds 25 sessions") and "LLM_INSPECTOR_MAX_SESSIONS" in msg
    assert reg.admit("browser:invented-0", keep[0], 8, total=25) is None     # an admitted session's reruns go on
    del keep[:10]                                                           # ten sessions end and are dropped
    gc.collect()
    assert reg.total() == 15 and reg.admit("browser:late-student", SessionToken(), 8, total=25) is None


def test_the_server_wide_cap_is_a_limit_with_a_default():
    assert Limits().max_sessions == 100
    assert Limits.from_env({"LLM_INSPECTOR_MAX_SESSIONS": "40"}).max_sessions == 40
