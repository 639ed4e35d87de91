"""Serving a room: one browser cannot take every slot; a session keeps at most its memory budget, dropping
derived data first; one run is never stepped twice at once; models and copies count against max_models."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine import InputError, RunSettings
from inspector.session import models
from inspector.session.admission import Admission, ServerBusyError
from inspector.session.budget import enforce, holdings, session_bytes
from inspector.session.limits import Limits
from inspector.session.state import SessionState
from inspector.session.stepper import Debugger

pytestmark = pytest.mark.unit


def hold(adm: Admission, client: str, started: list, release: threading.Event, errors: list) -> None:
    try:
        with adm.slot(client=client, timeout=30):
            started.append((client, time.monotonic()))
            release.wait(30)
    except ServerBusyError as e:
        errors.append((client, str(e)))


def test_one_browser_gets_one_running_and_one_waiting_run_and_never_delays_the_others():
    adm = Admission(max_concurrent=2, max_queue=32, heartbeat_s=0.05)
    started, errors, release = [], [], threading.Event()
    greedy = [threading.Thread(target=hold, args=(adm, "tabs", started, release, errors)) for _ in range(10)]
    for t in greedy:
        t.start()
    time.sleep(0.5)
    assert [c for c, _ in started] == ["tabs"]                   # its second run waits behind its first
    assert len(errors) == 8 and all("You already have 1 run(s) generating and 1 waiting" in e for _, e in errors)
    other = threading.Thread(target=hold, args=(adm, "student", started, release, errors))
    other.start()
    time.sleep(0.3)
    assert [c for c, _ in started] == ["tabs", "student"]        # a free slot goes to the other browser at once
    release.set()
    for t in greedy + [other]:
        t.join(10)
    assert [c for c, _ in started] == ["tabs", "student", "tabs"] and adm.state().running == 0


def test_runs_without_a_client_are_not_limited_per_client():
    adm = Admission(max_concurrent=3, max_queue=4)
    with adm.slot(client=None), adm.slot(client=None), adm.slot(client=None):
        assert adm.state().running == 3


def test_the_budget_drops_derived_data_first_and_never_the_run_on_screen():
    class Run:
        def __init__(self, n):
            self.ids, self.values = list(range(n)), torch.zeros(n, 256)
    current, earlier = Run(512), Run(512)
    state = SessionState(run=current, runs=[earlier, current], memos={
        "attn": {"old": torch.zeros(512, 512), "new": torch.zeros(256, 512)}, "tf_bytes": {"k": b"x" * 300_000}})
    assert [h.label for h in holdings(state)][:2] == ["a cached view (attn)"] * 2
    budget = session_bytes(state) - 512 * 512 * 4 + 1          # just over: the oldest map must go
    dropped = enforce(state, budget)
    assert dropped == ["a cached view (attn), 1.0 MiB"] and list(state.memos["attn"]) == ["new"]
    dropped = enforce(state, 1)                                 # nothing fits: all but the current run goes
    assert state.run is current and state.runs == [current] and not state.memos["attn"]
    assert not state.memos["tf_bytes"]
    assert any(d.startswith("an earlier run (512 positions)") for d in dropped)


def test_a_run_is_never_stepped_twice_at_once(tiny_model, monkeypatch):
    dbg = Debugger(tiny_model, RunSettings(prompt="one two three", chat=False, max_new_tokens=6))
    import inspector.session.stepper as stepper
    real, inside = stepper.run_until, threading.Event()

    def slow(*a, **k):
        inside.set()
        time.sleep(0.5)
        return real(*a, **k)
    monkeypatch.setattr(stepper, "run_until", slow)
    first = threading.Thread(target=dbg.step)
    first.start()
    inside.wait(5)
    with pytest.raises(InputError, match="already stepping"):
        dbg.step()
    first.join(10)
    assert len(dbg.steps) == 1 and dbg.run.cache.get_pos() == len(dbg.run.prompt_ids)
    dbg.step()
    assert len(dbg.steps) == 2


def test_models_loading_loaded_and_copies_count_against_max_models(tiny_model, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_MAX_MODELS", "2")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: tiny_model)
    models.shared_model.clear()
    base = models.shared_model(str(tiny_model_dir), "cpu", "float32")
    half = models.shared_copy(base, "bfloat16")
    assert half.dtype == torch.bfloat16 and models.shared_copy(base, "bfloat16") is half
    with pytest.raises(Exception, match="at most 2 model"):
        models.shared_model(str(tiny_model_dir), "cpu", "bfloat16")
    models.shared_model.clear()


def test_labels_and_load_errors_name_models_not_server_paths(tmp_path):
    src = str(tmp_path / "secret-folder" / "my-model")
    assert models.label(src) == "my-model" and models.label(None) == models.BUNDLED
    assert models.label("org/name") == "org/name"
    msg = models.redact(f"{src}/config.json not found in {tmp_path / 'secret-folder'}", src)
    assert "secret-folder" not in msg and "my-model" in msg


def test_limits_include_the_per_client_and_session_budget_variables():
    names = [row[0] for row in Limits().table()]
    assert {"LLM_INSPECTOR_MAX_RUNNING_PER_CLIENT", "LLM_INSPECTOR_MAX_QUEUED_PER_CLIENT",
            "LLM_INSPECTOR_MAX_SESSION_MB"} <= set(names)


def test_two_tabs_of_one_browser_are_one_client():
    """Streamlit's XSRF cookie as two tabs of one Chromium got it (Tornado masks the token afresh on every page
    load): one token, so one client; another browser's cookie is another client."""
    from inspector.ui.common import xsrf_token
    tab1 = "2|9906c7de|da55137ea6fb815edd687a4aa6f23960|1796079712"
    tab2 = "2|7429c16c|377a15cc4bd487ec30477cf84bdd3fd2|1796079712"
    assert tab1 != tab2 and xsrf_token(tab1) == xsrf_token(tab2) == "4353d4a03ffd4680446ebd943ff4febe"
    other = "2|00000000|1353d4a03ffd4680446ebd943ff4febe|1796079712"
    assert xsrf_token(other) != xsrf_token(tab1)
    assert xsrf_token("not|a|cookie") == "not|a|cookie" and xsrf_token("2|zz|zz|1") == "2|zz|zz|1"
