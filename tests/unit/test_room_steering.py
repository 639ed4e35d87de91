"""Issue 47, item 4: a steering vector shown to a room. The store keeps the teacher's vector and run as one validated
document under the room's state (a new version reruns the students' screens); the vector comes back bit for bit; a
hostile or oversized document is refused, and ending the room deletes it."""
from __future__ import annotations

import json

import pytest
import torch

from inspector.session.rooms import RoomStore
from inspector.session.rooms_memory import MemoryBackend
from inspector.session.rooms_state import Forbidden, RoomError
from inspector.session.rooms_steer import MAX_DIM, MAX_STEER_BYTES, RoomSteering

pytestmark = pytest.mark.unit


def run_dict(coefficient=4.0):
    return {"coefficient": coefficient, "layer": 1, "plain_text": " plain", "steered_text": " steered",
            "steps": [{"step": 0, "token": 5, "text": " st", "kl_steered_plain": 0.25, "p_steered": 0.5,
                       "p_plain": 0.125, "plain_top": 6, "plain_top_text": " pl"}]}


def doc(vector, coefficient=4.0):
    return RoomSteering.of_run("tiny", vector, ["I love it"], ["I hate it"], "Tell me", run_dict(coefficient))


def test_the_room_keeps_the_teachers_vector_bit_for_bit_under_a_new_version():
    store = RoomStore(MemoryBackend())
    code, token = store.create()
    assert store.steering(code) is None
    vec = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3.7      # float32 values
    before = store.state(code).version
    state = store.publish_steering(code, token, doc(vec.tolist()))
    assert state.version == before + 1 and state.steer_id is not None
    back = store.steering(code)
    assert torch.equal(torch.tensor(back.vector, dtype=torch.float32), vec)
    assert back.layer == 1 and back.coefficient == 4.0 and back.steps[0].kl == 0.25
    assert back.as_run()["steered_text"] == " steered" and abs(back.norm - float(vec.double().norm())) < 1e-9
    assert store.publish_steering(code, token, doc(vec.tolist())).version == state.version     # the same: no change
    newer = store.publish_steering(code, token, doc(vec.tolist(), coefficient=-2.0))
    assert newer.version == state.version + 1 and store.steering(code).coefficient == -2.0
    with pytest.raises(Forbidden):
        store.publish_steering(code, "not the token", doc(vec.tolist()))
    store.end(code, token)
    assert store.b.get(store._k(code, "steer")) is None


@pytest.mark.parametrize("change, said", [
    (lambda d: d | {"vector": [float("nan")] * 4}, "vector entry"),
    (lambda d: d | {"vector": [0.0] * (MAX_DIM + 1)}, "1 to"),
    (lambda d: d | {"coefficient": 1e9}, "coefficient"),
    (lambda d: d | {"positive": []}, "positive set"),
    (lambda d: d | {"steps": [{"step": 0}] * 65}, "at most 64 steps"),
    (lambda d: d | {"layer": -1}, "steering layer"),
    (lambda d: d | {"plain_text": "x" * 2_001}, "plain text"),
])
def test_a_hostile_steering_document_is_refused_naming_what_is_wrong(change, said):
    good = json.loads(doc([1.0, 2.0]).as_json())
    with pytest.raises(RoomError, match=said):
        RoomSteering.from_json(json.dumps(change(good)).encode())
    with pytest.raises(RoomError, match="not valid JSON"):
        RoomSteering.from_json(b"{")
    with pytest.raises(RoomError, match="at most"):
        RoomSteering.from_json(b" " * (MAX_STEER_BYTES + 1))


def test_a_store_holding_a_forged_document_is_read_as_an_error_not_shown():
    store = RoomStore(MemoryBackend())
    code, token = store.create()
    store.publish_steering(code, token, doc([1.0, 2.0]))
    store.b.set(store._k(code, "steer"), b'{"vector": "rm -rf"}', 60)
    with pytest.raises(RoomError):
        store.steering(code)
