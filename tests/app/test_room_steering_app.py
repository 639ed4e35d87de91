"""Issue 47, item 4, in the app: a teacher in a room steers on the Compare runs page and shows it to the room; a
student's Compare page draws the teacher's two continuations as published and adds the same vector to the same
prompt with the same coefficient, getting the teacher's steered continuation again (the vector travelled bit for
bit); on coefficient 0 the student's steered run is the plain one."""
from __future__ import annotations

import pytest
import torch

from engine import RunSettings
from engine.inspection.trace import to_bytes
from engine.tools.steering import steering_vector
from inspector.session.memo import run_key
from inspector.session.rooms import shared_store
from inspector.session.rooms_state import View
from inspector.session.run import inspect_run
from inspector.session.state import RoomSeat
from inspector.ui.state import session_of
from tests.app.test_app_pages_b import fresh_app
from tests.app.test_room_live_app import env  # noqa: F401  (a fixture: the tiny model, rooms in memory)

pytestmark = pytest.mark.app
PROMPT = "Tell me about lighthouses."


def test_a_teachers_steering_reaches_the_students_and_reruns_there(env, app_file, tiny_model):  # noqa: F811
    store = shared_store()
    code, token = store.create()
    run = inspect_run(tiny_model, RunSettings(prompt=PROMPT, chat=False, max_new_tokens=4, seed=3))
    view = View("compare")
    state = store.publish(code, token, run=to_bytes(run), view=view)

    teacher = fresh_app(app_file, env)
    session_of(teacher.session_state).runs = [run]
    session_of(teacher.session_state).run = run
    session_of(teacher.session_state).room = RoomSeat("teacher", code, token=token, page="compare", view=view,
                                                      run_key=run_key(run), run_id=state.run_id, published=True)
    teacher.switch_page("views/compare.py").run()
    teacher.number_input(key="steer_layer").set_value(1)
    teacher.number_input(key="steer_tokens").set_value(4)
    teacher.number_input(key="steer_coef").set_value(60.0)
    teacher.button(key="steer_run").click().run()
    assert not teacher.exception and not teacher.error, [e.value for e in teacher.error]
    mine = session_of(teacher.session_state).steered
    teacher.button(key="steer_publish").click().run()
    assert not teacher.error and any("The room shows this steering" in s.value for s in teacher.success)

    shown = store.steering(code)
    pos = [x for x in teacher.text_area(key="steer_pos").value.splitlines() if x.strip()]
    neg = [x for x in teacher.text_area(key="steer_neg").value.splitlines() if x.strip()]
    direct = steering_vector(tiny_model, pos, neg, 1)               # the engine's own vector, computed here
    assert torch.equal(torch.tensor(shown.vector, dtype=torch.float32), direct.vector)
    assert shown.steered_text == mine["steered_text"] != mine["plain_text"]

    student = fresh_app(app_file, env)
    student.query_params["room"] = code
    student.run()
    student.switch_page("views/compare.py").run()
    assert not student.exception, student.exception
    assert any("The teacher's steering" in m.value for m in student.markdown)
    assert mine["steered_text"] in [c.value for c in student.code]
    student.number_input(key="steer_room_tokens").set_value(4)
    assert student.number_input(key="steer_room_coef").value == 60.0
    student.button(key="steer_room_run").click().run()
    assert not student.exception and not student.error, [e.value for e in student.error]
    theirs = session_of(student.session_state).steered
    assert theirs["steered_ids"] == mine["steered_ids"] and theirs["steered_text"] == mine["steered_text"]
    student.number_input(key="steer_room_coef").set_value(0.0)
    student.button(key="steer_room_run").click().run()
    zero = session_of(student.session_state).steered
    assert zero["steered_ids"] == zero["plain_ids"] == mine["plain_ids"]
