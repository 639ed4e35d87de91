"""The room's parts of the app, run the way Streamlit runs them (AppTest): strings from a file, the store or a
browser reach the screen as plain text only (issue 19, item 9); tabs of one browser answer a poll once
(item 8); a teacher whose room is gone from the store (Redis restarted) ends it and is not left stuck
(item 10)."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
from streamlit.testing.v1 import AppTest

from engine import RunSettings
from inspector.session.rooms import shared_store
from inspector.session.rooms_state import Poll, RoomState
from inspector.session.run import inspect_run
from inspector.session.state import RoomSeat
from inspector.ui.state import session_of

pytestmark = pytest.mark.app
IMG = "![x](http://evil/img.png)"
LINK = "[log in again](http://x)"
TAG = '<a href="http://x">log in again</a>'
EVIL = f"{IMG} {LINK} {TAG}"
UNSAFE = re.compile(r"!\[x\]\(|\[log in again\]\(|(?<!\\)<a ")   # a Markdown image or link, an unescaped tag


def unsafe(bodies: list[str]) -> list[str]:
    return [b for b in bodies if UNSAFE.search(b)]


def poll_script():
    import streamlit as st

    from inspector.ui.room_poll import poll_box
    poll_box(st.session_state["_test_r"], st.session_state["_test_state"], 3)


def teacher_panel_script():
    from inspector.ui import room
    room.sidebar_panel()


def voter_script():
    import streamlit as st

    from inspector.ui.room_sync import voter_id
    st.session_state["_test_voter"] = voter_id("ABCDEF")


@pytest.fixture
def evil_run(tiny_model, monkeypatch, tiny_model_dir):
    import inspector.session.models as models
    monkeypatch.setattr(models, "load_model", lambda *a, **k: tiny_model)
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.delenv("LLM_INSPECTOR_ROOMS", raising=False)
    models.shared_model.clear()
    models.shared_model(str(tiny_model_dir), "cpu", "auto")
    run = inspect_run(tiny_model, RunSettings(prompt="one two three", chat=False, max_new_tokens=4))
    steps = [dataclasses.replace(s, text=EVIL if i == 0 else s.text,
                                 top=[dataclasses.replace(c, text=f"{EVIL} {k}") for k, c in enumerate(s.top)])
             for i, s in enumerate(run.result.steps)]
    run = dataclasses.replace(run, model_name=EVIL, notes=[EVIL],
                              result=dataclasses.replace(run.result, steps=steps))
    run.extra["room_run_id"] = "ab" * 16
    return run


def test_the_check_finds_what_it_looks_for():
    from inspector.ui.common import plain
    assert unsafe([EVIL, IMG, LINK, TAG, repr(EVIL)]) == [EVIL, IMG, LINK, TAG, repr(EVIL)]
    assert unsafe([plain(EVIL), plain(repr(EVIL)), "plain words"]) == []


def markdown_bodies(at) -> list[str]:
    """Every string the app handed to an element that draws Markdown (bodies, labels, radio options)."""
    out = []
    for kind in ("markdown", "caption", "info", "warning", "error", "success", "title", "header", "subheader"):
        out += [e.value for e in at.get(kind)]
    for r in at.radio:
        out += [r.label, *r.options]
    for kind in ("button", "text_input", "checkbox"):
        out += [e.label for e in at.get(kind)]
    return out


def poll_app(run, poll: Poll, answered: dict) -> AppTest:
    at = AppTest.from_function(poll_script, default_timeout=120)
    session_of(at.session_state).runs = [run]
    at.session_state["_test_r"] = RoomSeat("student", "ABCDEF", voter="ab" * 16, answered=answered)
    at.session_state["_test_state"] = RoomState("ABCDEF", 3, run_id="ab" * 16, poll=poll)
    return at.run()


def test_a_runs_strings_reach_the_poll_as_plain_text(evil_run):
    step = 1
    choices = tuple(sorted(c.id for c in evil_run.result.steps[step].top[:5]))
    at = poll_app(evil_run, Poll(id=1, step=step, choices=choices, run_id="ab" * 16), {})
    assert not at.exception, at.exception
    options = at.radio[0].options
    assert len(options) == len(choices) + 1
    assert unsafe(markdown_bodies(at)) == []
    assert any(EVIL in t.value for t in at.text)                                 # the text before the step
    assert any("log in again" in o for o in options)                             # shown, escaped


def test_an_answer_and_the_reveal_show_a_runs_strings_as_plain_text(evil_run):
    step = 1
    top = evil_run.result.steps[step].top
    poll = Poll(id=1, step=step, choices=tuple(sorted(c.id for c in top[:5])), revealed=True, run_id="ab" * 16)
    at = poll_app(evil_run, poll, {1: top[0].id})
    assert not at.exception, at.exception
    bodies = markdown_bodies(at)
    assert any(body.startswith("Your answer:") and "log in again" in body for body in bodies)
    assert unsafe(bodies) == []
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    labels = [x for trace in spec["data"] for x in trace["x"]]
    assert labels and not any("<a" in x for x in labels) and any("&lt;a href" in x for x in labels)


def test_tabs_of_one_browser_are_one_voter(monkeypatch):
    """Two sessions (two tabs) whose requests carry one browser's cookie answer under one name."""
    import inspector.ui.common
    monkeypatch.setattr(inspector.ui.common, "client_key", lambda: "browser:0123456789abcdef")
    voters = [AppTest.from_function(voter_script).run().session_state["_test_voter"] for _ in range(2)]
    assert voters[0] == voters[1]
    monkeypatch.setattr(inspector.ui.common, "client_key", lambda: "browser:fedcba9876543210")
    assert AppTest.from_function(voter_script).run().session_state["_test_voter"] != voters[0]


def test_a_teacher_whose_room_is_gone_ends_it_and_is_not_stuck(monkeypatch):
    monkeypatch.delenv("LLM_INSPECTOR_ROOMS", raising=False)
    store = shared_store()
    code, token = store.create()
    store.b.delete(*[store._k(code, part) for part in ("auth", "state", "ver")])   # what a Redis restart leaves
    at = AppTest.from_function(teacher_panel_script, default_timeout=60)
    session_of(at.session_state).room = RoomSeat.teacher(code, token)
    at.run()
    at.button(key="room_end").click().run()
    assert not at.exception, at.exception
    assert session_of(at.session_state).room is None
    assert any("no longer in the store" in w.value for w in at.warning)
    assert not at.error
    assert at.text_input(key="room_code") is not None                   # the join form: a session like any other
