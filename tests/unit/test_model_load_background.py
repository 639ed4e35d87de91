"""The registry's background load (inspector.session.models.model_load, issue 21 item 6): it never waits, every
caller reads the one load's progress, the loaded model is the shared one, and a failed load says why and is
tried again only after LOAD_RETRY_S."""
from __future__ import annotations

import threading
import time

import pytest

from engine import ModelLoadError
from inspector.session import models


def settled(source, timeout_s: float = 60.0) -> models.LoadState:
    """model_load's answer once the load has ended (polled; the limit only stops a hung test)."""
    end = time.monotonic() + timeout_s
    while (state := models.model_load(source, "cpu", "float32")).loading:
        assert time.monotonic() < end, state
        time.sleep(0.02)
    return state


@pytest.fixture
def held(monkeypatch, tiny_model):
    """A loader that reports (0.3, "step one") and then waits for gate; its calls are counted."""
    gate, calls = threading.Event(), []

    def load(source, *, device=None, dtype=None, progress=None, quant="dequantized"):     # load_model's own
        calls.append(source)
        progress(0.3, "step one")
        assert gate.wait(60)
        if source == "broken":
            raise ModelLoadError("the weights of broken are missing")
        return tiny_model
    monkeypatch.setattr(models, "load_model", load)
    models.shared_model.clear()
    yield gate, calls
    gate.set()
    models.shared_model.clear()


def test_callers_share_one_load_and_read_its_progress(held, tiny_model):
    gate, calls = held
    first = models.model_load("good", "cpu", "float32")          # answers at once: the gate is closed
    assert first.loading and first.model is None
    end = time.monotonic() + 60
    while (second := models.model_load("good", "cpu", "float32")).message != "step one":
        assert time.monotonic() < end, second
        time.sleep(0.01)
    assert second.loading and second.fraction == pytest.approx(0.3)
    assert calls == ["good"]                                     # one load for both callers
    gate.set()
    done = settled("good")
    assert done.model is tiny_model and done.error is None
    assert models.shared_model("good", "cpu", "float32") is tiny_model     # the registry's one model
    assert calls == ["good"]


def test_a_failed_load_says_why_and_is_tried_again_only_later(held, monkeypatch):
    gate, calls = held
    gate.set()
    failed = settled("broken")
    assert failed.model is None and failed.error == "the weights of broken are missing"
    assert models.model_load("broken", "cpu", "float32").error == failed.error      # within LOAD_RETRY_S
    assert calls == ["broken"]
    monkeypatch.setattr(models, "LOAD_RETRY_S", 0)              # the wait is over: this call starts a new load
    models.model_load("broken", "cpu", "float32")
    end = time.monotonic() + 60
    while len(calls) < 2:                                        # the loader is asked again
        assert time.monotonic() < end, calls
        time.sleep(0.01)
    monkeypatch.setattr(models, "LOAD_RETRY_S", 3600)
    assert settled("broken").error == failed.error
    assert calls == ["broken", "broken"]                         # tried again once the wait was over
