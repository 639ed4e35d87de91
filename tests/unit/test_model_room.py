"""The model registry's room (inspector.session.models): what keeps a model in use is a real reference — a session's
choice, its debugger, its generating run, or a computation holding the model — and an unloaded model is freed. The
weights' bytes by dtype (engine Weights.nbytes_by_dtype), counted by hand."""
from __future__ import annotations

import gc
import shutil
import time
import weakref

import pytest
import torch

from engine import RunSettings
from engine.weights import LayerWeights, Weights
from inspector.session import models
from inspector.session.state import SessionState
from inspector.session.stepper import Debugger

pytestmark = pytest.mark.unit


@pytest.fixture
def three(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_MAX_MODELS", "2")
    models.shared_model.clear()
    paths = []
    for name in ("m1", "m2", "m3"):
        shutil.copytree(tiny_model_dir, tmp_path / name)
        paths.append(str(tmp_path / name))
    yield paths
    models.shared_model.clear()


def loaded(source: str, user: SessionState) -> models.LoadState:
    """Ask as a page does (model_load never waits) until the load has ended."""
    end = time.monotonic() + 60
    while (state := models.model_load(source, "cpu", "float32", user=user)).loading and time.monotonic() < end:
        time.sleep(0.02)
    return state


def test_a_debugger_keeps_its_model_in_use_after_the_sidebar_moved_on(three):
    m1, m2, m3 = three
    teacher, other = SessionState(), SessionState()
    model = loaded(m1, teacher).model
    teacher.debugger = Debugger(model, RunSettings(prompt="one two", chat=False, max_new_tokens=2))
    ref, model = weakref.ref(model), None
    assert loaded(m2, teacher).model is not None          # the sidebar now shows m2; the debugger still runs m1
    state = loaded(m3, other)
    assert state.refused and "every one is in use (1 session holds them): m1 (cpu, float32): in use by 1 session; " \
                              "m2 (cpu, float32): in use by 1 session." in state.error, state.error
    teacher.debugger = None                               # the debugger closed: m1 is free
    state = loaded(m3, other)
    assert state.model is not None and not state.error
    gc.collect()
    assert ref() is None and [m.name for m in models.held()] == ["m2", "m3"]
    back = loaded(m1, teacher)                            # the teacher had m1: told it was unloaded, for m3
    assert back.model is not None and back.unloaded is not None and back.unloaded.for_label == "m3"
    assert loaded(m1, teacher).unloaded is None           # once


def test_a_closed_session_stops_holding_its_model(three):
    m1, m2, m3 = three
    gone, other = SessionState(), SessionState()
    loaded(m1, gone)
    loaded(m2, other)
    state = loaded(m3, other)                             # m2 is other's no longer: room by unloading m2, not m1
    assert state.model is not None and not state.refused and [m.name for m in models.held()] == ["m1", "m3"]
    del gone                                              # Streamlit dropped the session: m1 needs nobody
    gc.collect()
    assert loaded(m2, other).model is not None and [m.name for m in models.held()] == ["m3", "m2"]


def test_a_model_a_computation_still_holds_is_kept_not_unloaded(three):
    m1, m2, m3 = three
    working = models.shared_model(m1, "cpu", "float32")     # a page computing with it (no session chose it)
    models.shared_model(m2, "cpu", "float32")               # idle: nothing holds it
    third = models.shared_model(m3, "cpu", "float32")       # room made by unloading m2, never m1
    assert [m.name for m in models.held()] == ["m1", "m3"]
    with pytest.raises(models.NoRoomError, match=r"at most 2 model\(s\).*m1 \(cpu, float32\): a computation is "
                                                 r"running on it; m3 \(cpu, float32\): a computation is running"):
        models.shared_model(m2, "cpu", "float32")
    ref, working = weakref.ref(working), None
    models.shared_model(m2, "cpu", "float32")
    gc.collect()
    assert ref() is None and [m.name for m in models.held()] == ["m3", "m2"]        # m3: `third` still holds it


def test_weight_bytes_by_dtype_count_a_tied_embedding_once():
    V, d, f = 10, 4, 6
    embed = torch.zeros(V, d, dtype=torch.bfloat16)
    layer = LayerWeights(attn_norm=torch.ones(d), wqkv=torch.zeros(d, 3 * d), wo=torch.zeros(d, d),
                         mlp_norm=torch.ones(d), w_gate_up=torch.zeros(d, 2 * f, dtype=torch.float16),
                         w_down=torch.zeros(f, d, dtype=torch.float16))
    w = Weights(embed=embed, layers=[layer, layer], norm=torch.ones(d), lm_head=embed.t())
    by_hand = {torch.bfloat16: 2 * V * d,                         # embed once: lm_head is its view
               torch.float32: 4 * (d + d * 3 * d + d * d + d + d),  # one layer's (the list holds it twice) + norm
               torch.float16: 2 * (d * 2 * f + f * d)}
    assert w.nbytes_by_dtype() == by_hand and w.nbytes() == sum(by_hand.values())
    assert list(w.nbytes_by_dtype()) == [torch.float32, torch.float16, torch.bfloat16]      # largest first


def test_a_model_whose_load_failed_needs_room_when_it_is_tried_again(three, monkeypatch, tmp_path, tiny_model_dir):
    m1, m2, _ = three
    monkeypatch.setattr(models, "LOAD_RETRY_S", 1.0)          # a failed load is tried again a second later
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    teacher, student, other = SessionState(), SessionState(), SessionState()
    assert loaded(m1, teacher).model is not None
    first = loaded(str(broken), student)
    assert first.error and not first.refused                  # a load error (there was room)
    assert loaded(m2, other).model is not None                # now both models are in use
    shutil.rmtree(broken)
    shutil.copytree(tiny_model_dir, broken)                   # fixed: its failed load's record does not make room
    time.sleep(1.1)
    again = loaded(str(broken), student)
    assert again.refused and "(2 sessions hold them)" in again.error, again
    assert [m.name for m in models.held()] == ["m1", "m2"]
